"""Structure-aware mutations of a torch file: its object loaded, one or two entries changed (a key renamed, dropped
or retyped, a tensor replaced by another type or by a tensor of another kind, a tensor's shape or dtype changed, an
entry nested or flattened), then saved again with torch.save.

:data:`ODD_VALUES` and :func:`odd_kind` are the generators the three fuzzers share (this one, the Hypothesis
strategies of tests/test_hostile_structure.py and scripts/fuzz_atheris.py's ``pt_values``): numbers past their range
where a count, a size or a time is, and the tensor kinds ``torch.save`` writes as readily as dense ones but no resume
can take (sparse, nested, quantized, meta, expanded: a few stored bytes for 10**8 elements)."""

from __future__ import annotations

import copy
import io
import random
from typing import Any

import torch

# odd values a damaged entry takes: a pickled entry here, a JSON leaf in _fuzz_mutate (ints past int64 both ways)
ODD_VALUES: tuple[Any, ...] = (
    None, -1, 0, 2**63, 2**64 + 1, 2**70, -(10**30), 1e308, "x", "", [], {}, [1, 2], {"a": 1}, True, "F64",
)  # fmt: skip
TENSOR_KINDS = ("sparse", "nested", "quantized", "meta", "expanded", "expanded-huge")


def odd_kind(value: Any, kind: str) -> torch.Tensor:
    """``value``'s numbers (a tensor's, or 3.0) as a tensor of ``kind`` (one of :data:`TENSOR_KINDS`)."""
    plain = isinstance(value, torch.Tensor) and value.layout == torch.strided and not value.is_nested
    plain = plain and not (value.is_quantized or value.is_meta) and value.numel() <= 1 << 16
    # (a tensor of another kind already, or one of many elements, an expanded one maybe: 3.0 in its place, so that
    # making the new one never walks 10**8 elements)
    t = value.detach() if plain else torch.as_tensor(3.0)
    flat = t.reshape(-1) if t.numel() else torch.ones(2, dtype=t.dtype)
    if kind == "sparse":
        return flat.to_sparse()
    if kind == "nested":
        return torch.nested.nested_tensor([flat.float(), torch.ones(2)])
    if kind == "quantized":
        return torch.quantize_per_tensor(flat.float(), 0.1, 0, torch.quint8)
    if kind == "meta":
        return t.to("meta")
    if kind == "expanded":  # one stored value for each element, in the shape it had
        return flat[:1].expand(t.shape) if t.dim() else flat[:1].expand(3)
    return flat[:1].expand(10**8)  # expanded-huge: bytes in the file for one element, 10**8 of them to walk


def places(obj: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in ``obj`` (containers and leaves), but inside the long lists (an RNG state's 625 ints) the first
    three elements only."""
    out = [path]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += places(v, (*path, k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj[:3]):
            out += places(v, (*path, i))
    return out


def edited(obj: Any, path: tuple[Any, ...], action: str, value: Any, key: Any) -> Any:
    """A copy of ``obj`` with the place at ``path`` replaced by ``value`` (``action`` "set"), removed ("drop"),
    given one more entry ``key: value`` when it is a dict ("add"), or made a tensor of the kind ``value`` names
    ("kind": its numbers, sparse, nested, expanded...); a tuple on the way is rebuilt."""
    if not path:
        if action == "add" and isinstance(obj, dict):
            return {**obj, key: value}
        if action == "kind":
            return odd_kind(obj, value)
        return value if action == "set" else obj
    head, rest = path[0], path[1:]
    if isinstance(obj, dict):
        out: Any = type(obj)(obj)
        if not rest and action == "drop":
            out.pop(head, None)
        else:
            out[head] = edited(obj[head], rest, action, value, key)
        return out
    items = list(obj)
    if not rest and action == "drop":
        del items[head]
    else:
        items[head] = edited(obj[head], rest, action, value, key)
    return tuple(items) if isinstance(obj, tuple) else items


def _nodes(obj: Any, path: tuple[Any, ...] = (), depth: int = 0) -> list[tuple[Any, Any, tuple[Any, ...]]]:
    """``(container, key, path)`` for every entry of the dicts and lists under ``obj`` (not inside tensors)."""
    out: list[tuple[Any, Any, tuple[Any, ...]]] = []
    if depth > 12:
        return out
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        out.append((obj, key, (*path, key)))
        out.extend(_nodes(value, (*path, key), depth + 1))
    return out


def _renamed(key: Any, rng: random.Random) -> Any:
    if isinstance(key, str) and key:
        i = rng.randrange(len(key))
        return rng.choice((key + "_", key[:i] + chr(ord(key[i]) ^ 0x20 if key[i].isalpha() else 0x44) + key[i + 1 :]))
    if isinstance(key, int) and not isinstance(key, bool):
        return rng.choice((key + 1, str(key), -1))
    return "renamed"


def _reshaped(t: torch.Tensor, rng: random.Random) -> torch.Tensor:
    roll = rng.random()
    if roll < 0.3 and t.dim() >= 2:
        return t.t().contiguous()
    if roll < 0.6:
        return t.reshape(-1).clone()
    if roll < 0.8:
        return torch.cat([t.reshape(-1), t.reshape(-1)[:1]]) if t.numel() else torch.zeros(1, dtype=t.dtype)
    return t.reshape(-1)[:0].clone() if t.numel() else t.reshape(1, *t.shape)


_DTYPES = (torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool, torch.uint8)


def _structural_edit(obj: Any, rng: random.Random) -> str:
    """Change one entry of ``obj`` in place; the kind of change made (``untensor``: a tensor replaced by a number,
    None, a string, a list or a dict; ``retype``: any entry replaced by an odd value)."""
    nodes = _nodes(obj)
    tensors = [n for n in nodes if isinstance(n[0][n[1]], torch.Tensor)]
    if not nodes:
        return "none"
    kind = rng.choice(
        ("rename", "drop", "retype", "untensor", "shape", "shape", "dtype", "dtype", "nest", "flatten", "kind")
    )  # fmt: skip
    if kind == "kind":  # a tensor (or any entry) replaced by a tensor of another kind
        parent, key, _ = rng.choice(tensors or nodes)
        parent[key] = odd_kind(parent[key], rng.choice(TENSOR_KINDS))
        return f"struct-{kind}"
    if kind in ("shape", "dtype", "untensor") and tensors:
        parent, key, _ = rng.choice(tensors)
        t = parent[key]
        if kind == "untensor":  # a tensor entry replaced by another type (a model weight by a float)
            parent[key] = rng.choice((1.5, 0, None, "x", t.reshape(-1)[:3].tolist(), {"value": 1.0}, True))
        elif kind == "shape":
            parent[key] = _reshaped(t, rng)
        else:
            parent[key] = t.to(rng.choice([d for d in _DTYPES if d != t.dtype]))
        return f"struct-{kind}"
    parent, key, _ = rng.choice(nodes)
    value = parent[key]
    if kind == "rename" and isinstance(parent, dict):
        parent[_renamed(key, rng)] = parent.pop(key)
    elif kind == "drop":
        del parent[key]
    elif kind == "nest":
        parent[key] = rng.choice(({"value": value}, [value], {key: value} if isinstance(key, str) else (value,)))
    elif kind == "flatten" and isinstance(value, (dict, list)) and value:
        inner = list(value.values() if isinstance(value, dict) else value)
        parent[key] = rng.choice(inner)
    else:
        kind = "retype"
        like = torch.zeros(3) if not isinstance(value, torch.Tensor) else value.tolist()
        parent[key] = copy.deepcopy(rng.choice((*ODD_VALUES, like, str(value)[:20])))  # never the shared ones
    return f"struct-{kind}"


def structural(original: bytes, rng: random.Random, cache: dict[bytes, Any]) -> tuple[str, bytes] | None:
    """One structure-aware mutation of a torch file (loaded once per original, kept in ``cache``): a key renamed,
    dropped or retyped inside the pickled object, a state tensor's shape or dtype changed, an entry nested in a
    new container or replaced by one of its own entries; re-saved with torch.save. None for a file it cannot load."""
    if original not in cache:
        try:
            cache[original] = torch.load(io.BytesIO(original), weights_only=True, map_location="cpu")
        except Exception:
            cache[original] = None
    base = cache[original]
    if base is None:
        return None
    obj = copy.deepcopy(base)
    if not isinstance(obj, (dict, list)):
        return None
    kind = _structural_edit(obj, rng)
    if rng.random() < 0.2:  # sometimes two changes
        kind += "+" + _structural_edit(obj, rng).removeprefix("struct-")
    buf = io.BytesIO()
    torch.save(obj, buf)
    return kind, buf.getvalue()
