"""Helpers that test modules import (``from tests.helpers import ...``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.serialization as ts

__all__ = ["device_tagging", "save_with_device_tag"]

Tag = str | Callable[[Any], str | None]


@contextlib.contextmanager
def device_tagging(tag: Tag = "cuda:3") -> Iterator[None]:
    """While active, ``torch.save`` records CPU storages under the location ``tag`` (a string, or a
    callable ``storage -> str | None``; None falls through to torch's own taggers) instead of ``cpu``.

    This is how a checkpoint "saved on cuda:3" is made on a CPU-only host (FACTS #4). Loading is not
    affected: the registered deserializer always returns None, so torch's own deserializers decide.
    """

    def tagger(storage: Any) -> str | None:
        if storage.device.type != "cpu":
            return None
        return tag(storage) if callable(tag) else tag

    def deserializer(storage: Any, location: str) -> None:
        return None

    # Lower number = asked first; torch's CPU tagger is 10. A unique priority also keeps the registry's
    # list.sort() from comparing two functions when priorities tie.
    priority = min(entry[0] for entry in ts._package_registry) - 1
    ts.register_package(priority, tagger, deserializer)  # appends (priority, tagger, deserializer)
    try:
        yield
    finally:
        ts._package_registry[:] = [e for e in ts._package_registry if e[1] is not tagger]


def save_with_device_tag(obj: Any, path: str | os.PathLike[str], tag: Tag = "cuda:3") -> None:
    """``torch.save(obj, path)`` with every CPU storage tagged ``tag`` (default ``"cuda:3"``)."""
    with device_tagging(tag):
        torch.save(obj, path)
