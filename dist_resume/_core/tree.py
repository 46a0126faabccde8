"""Walking nested containers of tensors (state dicts, optimizer state, checkpoints): the one walker.

Every module that needs the tensors inside a nested object uses these functions; none keeps a
walker of its own. :func:`structure_problem` is the guard in front of the recursive ones: a
loaded pickle can hold a cycle or nest thousands deep, which no state dict does.
"""

from __future__ import annotations

import argparse
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any, Final

import torch

from .text import article

__all__ = [
    "map_tensors",
    "iter_tensors",
    "named_tensors",
    "structure_problem",
    "MAX_NESTING",
    "set_path",
    "plain_namespaces",
]


def map_tensors(obj: Any, fn: Callable[[Any], Any], kind: type = torch.Tensor, *, share_unchanged: bool = False) -> Any:
    """``obj`` with every tensor (every ``kind`` instance) replaced by ``fn(it)``; dicts keep their type and ``_metadata``.

    Walks dicts, lists and tuples. With ``share_unchanged`` a container in which ``fn`` changed
    nothing is returned as it is (the same object), so a caller can tell "nothing moved" by identity.
    """
    if isinstance(obj, kind):
        return fn(obj)
    if isinstance(obj, dict):
        items = {key: map_tensors(value, fn, kind, share_unchanged=share_unchanged) for key, value in obj.items()}
        if share_unchanged and all(items[k] is v for k, v in obj.items()):
            return obj
        out: dict[Any, Any] = OrderedDict(items) if isinstance(obj, OrderedDict) else items
        meta = getattr(obj, "_metadata", None)
        if meta is not None:
            out._metadata = meta  # type: ignore[attr-defined]
        return out
    if isinstance(obj, (list, tuple)):
        values = [map_tensors(v, fn, kind, share_unchanged=share_unchanged) for v in obj]
        if share_unchanged and all(a is b for a, b in zip(values, obj)):
            return obj
        return type(obj)(values)
    return obj


def named_tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor inside ``obj`` with its path from ``prefix``: ``prefix['state'][0]``, depth first.

    Walks mappings, lists, tuples, sets and frozensets. Each container is walked once, so a
    container reachable twice (or a cycle, which a pickle can hold) neither repeats nor loops.
    """
    return _walk(obj, prefix, set())


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside ``obj``, depth first, in the order and with the rules of :func:`named_tensors`."""
    return (t for _, t in _walk(obj, None, set()))


def _walk(obj: Any, path: str | None, seen: set[int]) -> Iterator[tuple[str, torch.Tensor]]:
    # ``path`` None: the caller wants no paths, so none is built
    if isinstance(obj, torch.Tensor):
        yield path or "", obj
        return
    if not isinstance(obj, (Mapping, list, tuple, set, frozenset)) or id(obj) in seen:
        return
    seen.add(id(obj))
    pairs = obj.items() if isinstance(obj, Mapping) else enumerate(obj)
    for key, value in pairs:
        sub = None if path is None else (f"{path}[{key!r}]" if isinstance(obj, Mapping) else f"{path}[{key}]")
        yield from _walk(value, sub, seen)


MAX_NESTING: Final = 100  # a state dict nests 3 to 6 deep; a pickle can nest until a recursive walker overflows


def structure_problem(obj: Any) -> str | None:
    """Why a loaded object cannot be walked, or ``None``: a container that contains itself, or nesting
    deeper than :data:`MAX_NESTING`. It recurses at most ``MAX_NESTING + 1`` levels, so it never
    overflows the stack itself; an object reachable twice (shared, not cyclic) is fine. The path shown
    is at most three levels long.

    Every reader runs it on what it loaded, so it enters containers only: a state dict's tensors and
    numbers are passed over by their exact type, without a path built for them.
    """
    on_path: set[int] = set()
    done: set[int] = set()
    trail: list[tuple[Any, bool]] = []  # (key, in a mapping) of each step from the root to the current node

    def visit(node: Any) -> str | None:
        if id(node) in done:
            return None
        if id(node) in on_path:
            return f"{article(type(node).__name__)} at {_shown(trail)} contains itself"
        if len(trail) > MAX_NESTING:
            return f"containers nested more than {MAX_NESTING} deep at {_shown(trail[:1])}"
        on_path.add(id(node))
        in_mapping = isinstance(node, Mapping)
        for key, value in node.items() if in_mapping else enumerate(node):
            if type(value) not in _LEAF_TYPES and isinstance(value, _CONTAINERS):
                trail.append((key, in_mapping))
                problem = visit(value)
                trail.pop()
                if problem is not None:
                    return problem
        on_path.discard(id(node))
        done.add(id(node))
        return None

    return visit(obj) if isinstance(obj, _CONTAINERS) else None


_CONTAINERS: Final = (Mapping, list, tuple, set, frozenset)
_LEAF_TYPES: Final = frozenset({torch.Tensor, int, float, str, bytes, bool, type(None)})  # the ABC check is slow


def _shown(trail: list[tuple[Any, bool]]) -> str:
    """A path as ``['a'][0]['b']``, cut after three levels."""
    labels = [f"[{key!r}]" if in_mapping else f"[{key}]" for key, in_mapping in trail[:3]]
    return "".join(labels) + ("..." if len(trail) > 3 else "")


def set_path(root: Any, path: tuple[Any, ...], value: Any) -> None:
    """``root[path[0]][path[1]]... = value``, creating the lists (an int key next) and dicts on the way. Local."""
    node = root
    for key, nxt in itertools.pairwise(path):
        default: Any = [] if type(nxt) is int else {}
        if isinstance(node, list):
            node.extend([None] * (key + 1 - len(node)))
            if node[key] is None:
                node[key] = default
        else:
            node.setdefault(key, default)
        node = node[key]
    if isinstance(node, list):
        node.extend([None] * (path[-1] + 1 - len(node)))
    node[path[-1]] = value


def plain_namespaces(obj: Any) -> Any:
    """``obj`` with every ``argparse.Namespace`` replaced by a plain dict (``vars(ns)``); dicts and lists change
    in place, so objects found elsewhere (the model state dict) keep their identity. Local."""
    if isinstance(obj, argparse.Namespace):
        return {k: plain_namespaces(v) for k, v in vars(obj).items()}
    if isinstance(obj, MutableMapping):
        for k, v in list(obj.items()):
            new = plain_namespaces(v)
            if new is not v:
                obj[k] = new
        return obj
    if isinstance(obj, list):
        obj[:] = [plain_namespaces(v) for v in obj]
        return obj
    if type(obj) is tuple:
        items = tuple(plain_namespaces(v) for v in obj)
        return obj if all(a is b for a, b in zip(items, obj)) else items
    return obj
