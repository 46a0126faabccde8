"""``dist-resume verify`` without torch: two equal checkpoint files of this toolkit.

Two files of this toolkit (unprefixed keys, no ``--part``) are compared as :func:`._compare.compare_parts` compares
them, each read with :func:`~dist_resume._format.peek.peek_archive` (a stub unpickler), tensors by the bytes of their
records; this path answers only "equal": the first difference, or anything the torch path would read another way,
raises :class:`PeekUnsure` and hands the pair to the torch path, which words it (tests/test_cli_fast.py compares both
paths on a corpus of pairs). ``list``'s fast path and the names both read are :mod:`._fast`'s.
"""

from __future__ import annotations

import mmap
import zipfile
from contextlib import ExitStack
from typing import Any, Final

from .._core.errors import CheckpointError
from .._core.location import Location, RemotePath, local_path
from .._format.peek import Peeked, PeekUnsure, TensorStub, peek_archive
from .._layout.meta import toolkit_meta
from ._common import SCHEMA_PREFIX
from ._fast import FORMAT_KEY, FORMAT_NAME, FORMAT_VERSION, META_KEY, PLAIN

__all__ = ["fast_verify"]

# dist_resume._state.optim.keys.GROUP_BOOKKEEPING and the parts _layout.layout keys a toolkit file by (tests check)
_GROUP_BOOKKEEPING: Final = frozenset({"params", "param_names"})
_KEYED_PARTS: Final = ("model", "optimizer", "scheduler", "scaler", "ema")
_CHUNK: Final = 16 << 20


def _plain_key(key: Any) -> bool:
    """Whether ``key`` is already canonical and unprefixed (``canonical_key(key) == key``, prefix style ``none``)."""
    if type(key) is not str:
        return False
    parts = key.split(".")
    return "_orig_mod" not in parts and (len(parts) == 1 or parts[0] != "module")


class _Equal:
    """The comparison of :func:`._compare.compare_parts` for sides that are equal; any difference is unsure."""

    def __init__(self, sides: list[Peeked], views: list[mmap.mmap]) -> None:
        self.sides, self.views = sides, views
        self.records = [{r.name: r for r in s.records} for s in sides]
        self.tensors = {"model": 0, "optimizer": 0, "other": 0}
        self.bytes = 0
        self.not_compared: list[str] = []

    def compare(self, part: str, a: Any, b: Any) -> None:
        if isinstance(a, TensorStub):
            self.tensors[part if part in self.tensors else "other"] += 1
            self.bytes += a.numel * a.storage.itemsize
        if not self._same(a, b):
            raise PeekUnsure(f"{part} differs: the torch path words the difference")

    def _same(self, a: Any, b: Any) -> bool:
        if isinstance(a, TensorStub) and isinstance(b, TensorStub):
            if a.shape != b.shape or a.storage.dtype != b.storage.dtype:
                return False
            if not a.numel:
                return True
            if not (a.is_contiguous and b.is_contiguous):
                raise PeekUnsure("a tensor that is a strided view")
            (va, fa), (vb, fb), size = self._span(0, a), self._span(1, b), a.numel * a.storage.itemsize
            # compared a chunk at a time: memory-mapped pages come and go, no chunk outlives its comparison
            return all(
                va[fa + i : fa + min(i + _CHUNK, size)] == vb[fb + i : fb + min(i + _CHUNK, size)]
                for i in range(0, size, _CHUNK)
            )
        if isinstance(a, dict) and isinstance(b, dict):
            return set(a) == set(b) and all(self._same(a[k], b[k]) for k in a)
        if type(a) is not type(b) or not isinstance(a, (list, tuple, *PLAIN)):
            return False  # (another kind of value: the torch path decides)
        if isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(self._same(x, y) for x, y in zip(a, b))
        return bool(a == b)

    def _span(self, side: int, t: TensorStub) -> tuple[mmap.mmap, int]:
        """The memory-mapped file of ``side`` and where ``t``'s bytes start in it."""
        peeked = self.sides[side]
        name = f"{peeked.archive_name}/data/{t.storage.key}"
        record = self.records[side].get(name)
        start, size = t.offset * t.storage.itemsize, t.numel * t.storage.itemsize
        if record is None or record.compress_type != zipfile.ZIP_STORED or start + size > record.file_size:
            raise PeekUnsure(f"tensor data {name!r} not stored as torch.save stores it")
        return self.views[side], record.data_offset + start


def _toolkit(path: Location) -> Peeked:
    p = path
    if isinstance(p, RemotePath):
        raise PeekUnsure(f"{p} is on an object store: torch's path reads it by ranges")
    if not p.is_file() or p.suffix == ".safetensors":
        raise PeekUnsure(f"{p.name} is not a torch file")
    try:
        peeked = peek_archive(p)
    except (CheckpointError, OSError) as err:
        raise PeekUnsure(f"{p.name}: {err}") from err
    obj = peeked.obj
    if not isinstance(obj, dict) or obj.get(FORMAT_KEY) != FORMAT_NAME or not isinstance(obj.get("model"), dict):
        raise PeekUnsure(f"{p.name} is not a checkpoint of this toolkit")
    if type(obj.get(*FORMAT_VERSION)) is not int or obj.get(*FORMAT_VERSION) != FORMAT_VERSION[1]:
        raise PeekUnsure(f"{p.name} is of another format version")  # the torch path says which, and what to do
    if not all(_plain_key(k) for k in obj["model"]) or not isinstance(obj.get(META_KEY) or {}, dict):
        raise PeekUnsure(f"{p.name}: model keys with wrapper prefixes")
    try:
        toolkit_meta(obj, p.name)
    except CheckpointError as err:  # metadata the torch path refuses: its words, not ours
        raise PeekUnsure(f"{p.name}: {err}") from err
    return peeked


def _param_order(groups: list[Any]) -> list[tuple[str, Any]]:
    if not all(isinstance(g.get("params", []), list) and isinstance(g.get("param_names", []), list) for g in groups):
        raise PeekUnsure("param groups whose params or param_names are not lists")
    named = all("param_names" in g for g in groups)
    pids = [pid for g in groups for pid in g.get("params", [])]
    if not all(type(pid) in (int, str) for pid in pids):
        raise PeekUnsure("parameter ids that are not ints or names")
    if named:
        names = [n for g in groups for n in g["param_names"]]
        if not all(_plain_key(n) for n in names):
            raise PeekUnsure("optimizer param_names with wrapper prefixes")
        if len(names) == len(pids):
            return list(zip(names, pids))
    return [(f"param {n}", pid) for n, pid in enumerate(pids)]


def _optimizers(a: Any, b: Any, eq: _Equal) -> None:
    if a is None or b is None:
        if (a is None) != (b is None):
            eq.not_compared.append(f"optimizer (only {'B' if a is None else 'A'} has one)")
        return
    for o in (a, b):
        ok = isinstance(o, dict) and isinstance(o.get("state"), dict) and isinstance(o.get("param_groups"), list)
        if not ok or not all(isinstance(g, dict) for g in o["param_groups"]):
            raise PeekUnsure("an optimizer state that is not Optimizer.state_dict()'s")
    ga, gb = a["param_groups"], b["param_groups"]
    if len(ga) != len(gb):
        raise PeekUnsure("optimizers with different groups")
    for x, y in zip(ga, gb):
        hx = {k: v for k, v in x.items() if k not in _GROUP_BOOKKEEPING}
        hy = {k: v for k, v in y.items() if k not in _GROUP_BOOKKEEPING}
        if set(hx) != set(hy):
            raise PeekUnsure("groups with different hyper-parameters")
        for key in (k for k in hx if k in hy):
            eq.compare("optimizer", hx[key], hy[key])
    pa, pb = dict(_param_order(ga)), dict(_param_order(gb))
    if set(pa) != set(pb):
        raise PeekUnsure("optimizers over different parameters")
    for label, ida in pa.items():
        sa, sb = a["state"].get(ida), b["state"].get(pb[label])
        if sa is None and sb is None:
            continue
        if not (isinstance(sa, dict) and isinstance(sb, dict)) or set(sa) != set(sb):
            raise PeekUnsure(f"optimizer state of {label} differs")
        for key in sorted(sa, key=str):
            eq.compare("optimizer", sa[key], sb[key])


def _number(obj: dict[str, Any], name: str) -> int | None:
    value = (obj.get(META_KEY) or {}).get(name)
    if value is not None and type(value) is not int:
        raise PeekUnsure(f"a {name} that is not an int")  # (as_int's other cases: the torch path reads them)
    return value


def fast_verify(a: Location, b: Location) -> dict[str, Any]:
    """The ``verify`` report of two equal checkpoint files of this toolkit, read without torch, or
    :class:`PeekUnsure` (a difference included: the torch path words it). Local."""
    sides = [_toolkit(a), _toolkit(b)]
    with ExitStack() as stack:
        views = [
            stack.enter_context(
                mmap.mmap(
                    stack.enter_context(open(local_path(s.path, "fast_verify"), "rb")).fileno(),
                    0,
                    access=mmap.ACCESS_READ,
                )
            )
            for s in sides
        ]
        eq = _Equal(sides, views)
        ma, mb = sides[0].obj["model"], sides[1].obj["model"]
        if set(ma) != set(mb):
            raise PeekUnsure("models with different keys")
        for key in ma:
            eq.compare("model", ma[key], mb[key])
        _optimizers(sides[0].obj.get("optimizer"), sides[1].obj.get("optimizer"), eq)
        for part in ("epoch", "step", "scheduler", "scaler"):
            if part in ("epoch", "step"):
                x, y = _number(sides[0].obj, part), _number(sides[1].obj, part)
            else:
                x, y = sides[0].obj.get(part), sides[1].obj.get(part)
            if x is not None and y is not None:
                eq.compare(part, x, y)
            elif (x is None) != (y is None):
                eq.not_compared.append(f"{part} (only {'B' if x is None else 'A'} has one)")
    keys = [{part: part for part in _KEYED_PARTS if part in s.obj} for s in sides]
    return {
        "schema": f"{SCHEMA_PREFIX}/verify/1",
        "a": {"path": str(a), "layout": FORMAT_NAME, "prefix_style": "none", "part_keys": keys[0]},
        "b": {"path": str(b), "layout": FORMAT_NAME, "prefix_style": "none", "part_keys": keys[1]},
        "equal": True,
        "compared": {
            "model_tensors": eq.tensors["model"],
            "optimizer_tensors": eq.tensors["optimizer"],
            "bytes": eq.bytes,
        },
        "not_compared": eq.not_compared,
        "differences": [],
    }
