"""Public modules report their own path: exported classes and functions get ``__module__`` set to it."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["publish"]


def publish(namespace: Mapping[str, Any], names: Iterable[str], module: str) -> None:
    """Set ``__module__ = module`` on every class and function ``names`` exports (not on modules or values) that
    still reports a private module: one re-exported from another public module keeps that module's path.

    So reprs, tracebacks and pickles name the public path (``dist_resume.errors.UsageError``). A class's string
    annotations (``from __future__ import annotations``) resolve in its module's namespace, which the rename
    would hide from ``typing.get_type_hints``: they are resolved first. Functions resolve theirs in
    ``__globals__`` and need nothing.
    """
    for name in names:
        obj = namespace[name]
        private = any(part.startswith("_") for part in obj.__module__.split("."))  # dist_resume._x, dist_resume.cli._y
        if not (inspect.isclass(obj) or inspect.isfunction(obj)) or not private:
            continue
        if inspect.isclass(obj):
            own = inspect.get_annotations(obj)
            if own:
                hints = typing.get_type_hints(obj)
                obj.__annotations__ = {key: hints[key] for key in own}
        obj.__module__ = module
