"""The mutations of the fuzz corpus's files, by what each file is: a torch zip archive (bytes flipped, cut, spliced
and 4-byte fields set to extremes, aimed at its regions; or structure-aware, ``_fuzz_structural``), safetensors (its
header JSON, its length field, its bytes), JSON (one leaf, key or name damaged) and other bytes."""

from __future__ import annotations

import json
import random
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _fuzz_structural import ODD_VALUES, structural


@dataclass(frozen=True)
class Regions:
    """Byte ranges of one zip archive: the pickle record's data, tensor data, local headers, directory."""

    pickle: tuple[int, int]
    tensors: list[tuple[int, int]]
    local_headers: list[tuple[int, int]]
    central: tuple[int, int]
    eocd: int


def regions(data: bytes, path: Path) -> Regions:
    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
    pickle_range, tensors, headers = (0, 0), [], []
    for info in infos:
        start = info.header_offset
        name_len, extra_len = struct.unpack_from("<HH", data, start + 26)
        body = start + 30 + name_len + extra_len
        headers.append((start, start + 30 + name_len + extra_len))
        if info.filename.endswith("data.pkl"):
            pickle_range = (body, body + info.compress_size)
        elif "/data/" in info.filename:
            tensors.append((body, body + info.compress_size))
    eocd = data.rfind(b"PK\x05\x06")
    cd_size, cd_offset = struct.unpack_from("<II", data, eocd + 12)
    if cd_offset == 0xFFFFFFFF or cd_offset > len(data):  # zip64: look at the zip64 end record instead
        cd_offset = min(h[0] for h in headers[-1:]) if headers else 0
    return Regions(pickle_range, tensors, headers, (cd_offset, eocd), eocd)


def _flip(data: bytearray, lo: int, hi: int, rng: random.Random, count: int) -> None:
    if hi <= lo:
        return
    for _ in range(count):
        pos = rng.randrange(lo, hi)
        data[pos] ^= 1 << rng.randrange(8) if rng.random() < 0.5 else rng.randrange(1, 256)


_EXTREMES = (0, 0xFFFFFFFF, 0x7FFFFFFF)
# offsets of 4-byte fields: local header (crc, sizes), central directory entry (crc, sizes, offset), end record
_LOCAL_FIELDS = (14, 18, 22)
_CENTRAL_FIELDS = (16, 20, 24, 42)
_EOCD_FIELDS = (12, 16)


def _central_entries(data: bytes, lo: int, hi: int) -> list[int]:
    out, pos = [], data.find(b"PK\x01\x02", lo, hi)
    while pos != -1:
        out.append(pos)
        pos = data.find(b"PK\x01\x02", pos + 4, hi)
    return out


def mutate(original: bytes, path: Path, other: bytes, rng: random.Random) -> tuple[str, bytes]:
    """One seeded mutation of ``original`` (``path`` is where it lies; ``other`` another corpus file)."""
    reg = regions(original, path)
    data = bytearray(original)
    kind = rng.choice(
        ["pickle", "pickle", "pickle", "central", "local", "tensor", "truncate", "splice", "field4", "field4", "pkl4"]
    )
    if kind == "pickle":
        _flip(data, *reg.pickle, rng, rng.choice((1, 1, 2, 4)))
    elif kind == "central":
        _flip(data, reg.central[0], len(data), rng, rng.choice((1, 2)))
    elif kind == "local":
        lo, hi = rng.choice(reg.local_headers)
        _flip(data, lo, hi, rng, 1)
    elif kind == "tensor":
        lo, hi = rng.choice(reg.tensors) if reg.tensors else reg.pickle
        _flip(data, lo, hi, rng, rng.choice((1, 8)))
    elif kind == "truncate":
        cut = rng.choice((rng.randrange(len(data)), reg.central[0] + rng.randrange(max(1, len(data) - reg.central[0]))))
        return kind, bytes(data[:cut])
    elif kind == "splice":
        cut_a, cut_b = rng.randrange(len(data)), rng.randrange(len(other))
        return kind, bytes(data[:cut_a] + other[cut_b:])
    elif kind == "field4":
        where = rng.choice(("local", "central", "eocd"))
        if where == "local":
            base = rng.choice(reg.local_headers)[0] + rng.choice(_LOCAL_FIELDS)
        elif where == "central" and (entries := _central_entries(original, *reg.central)):
            base = rng.choice(entries) + rng.choice(_CENTRAL_FIELDS)
        else:
            base = reg.eocd + rng.choice(_EOCD_FIELDS)
        struct.pack_into("<I", data, base, rng.choice(_EXTREMES))
        kind = f"field4-{where}"
    else:  # a 4-byte run inside the pickle (BINUNICODE / BINBYTES lengths, BININT storage sizes)
        lo, hi = reg.pickle
        if hi - lo > 4:
            struct.pack_into("<I", data, rng.randrange(lo, hi - 4), rng.choice(_EXTREMES))
    return kind, bytes(data)


def _generic(data: bytearray, other: bytes, rng: random.Random) -> tuple[str, bytes]:
    """Byte-level damage of a file with no zip structure: flips, truncation, splice, a 4-byte extreme."""
    kind = rng.choice(["flip", "flip", "truncate", "splice", "field4"])
    if not data:
        return "empty", bytes(other[: rng.randrange(1, 64)])
    if kind == "flip":
        _flip(data, 0, len(data), rng, rng.choice((1, 2, 8)))
    elif kind == "truncate":
        return kind, bytes(data[: rng.randrange(len(data))])
    elif kind == "splice":
        return kind, bytes(data[: rng.randrange(len(data))] + other[rng.randrange(len(other)) :])
    elif len(data) >= 4:
        struct.pack_into("<I", data, rng.randrange(len(data) - 3), rng.choice(_EXTREMES))
    return kind, bytes(data)


def _damage_json(value: Any, rng: random.Random) -> Any:
    """``value`` (parsed JSON) with one leaf replaced, one key deleted or one key renamed."""
    if isinstance(value, dict) and value and rng.random() < 0.7:
        key = rng.choice(sorted(value))
        roll = rng.random()
        if roll < 0.15:
            return {k: v for k, v in value.items() if k != key}
        if roll < 0.25:
            return {(k + "_" if k == key else k): v for k, v in value.items()}
        return {**value, key: _damage_json(value[key], rng)}
    if isinstance(value, list) and value and rng.random() < 0.7:
        i = rng.randrange(len(value))
        return [*value[:i], _damage_json(value[i], rng), *value[i + 1 :]]
    if isinstance(value, int) and not isinstance(value, bool) and rng.random() < 0.5:
        return value + rng.choice((1, -1, 7, 1 << 40))
    return rng.choice(ODD_VALUES)


def _json_mutation(data: bytes, other: bytes, rng: random.Random) -> tuple[str, bytes]:
    try:
        value = json.loads(data)
    except ValueError:
        return _generic(bytearray(data), other, rng)
    if rng.random() < 0.7:
        return "json", json.dumps(_damage_json(value, rng)).encode()
    return _generic(bytearray(data), other, rng)


def _safetensors_mutation(data: bytes, other: bytes, rng: random.Random) -> tuple[str, bytes]:
    """Damage of a safetensors file: its header JSON (re-framed or not), its length field, or its bytes."""
    (size,) = struct.unpack_from("<Q", data, 0)
    header, body = data[8 : 8 + size], data[8 + size :]
    roll = rng.random()
    if roll < 0.45:
        damaged = json.dumps(_damage_json(json.loads(header), rng)).encode()
        if rng.random() < 0.85:  # keep the frame consistent so the header parser sees the damage
            return "st-header", struct.pack("<Q", len(damaged)) + damaged + body
        return "st-header-raw", data[:8] + damaged + body
    if roll < 0.6:
        value = rng.choice((0, 1, size - 1, size + 1, len(data), 2**32, 2**63, 2**64 - 1))
        return "st-length", struct.pack("<Q", value) + data[8:]
    if roll < 0.75:
        buf = bytearray(data)
        _flip(buf, 8, 8 + size, rng, rng.choice((1, 2)))
        return "st-header-bytes", bytes(buf)
    return _generic(bytearray(data), other, rng)


STRUCTURAL_SHARE = 0.5  # of the mutations of a torch file


def mutate_file(
    original: bytes,
    path: Path,
    other: bytes,
    rng: random.Random,
    cache: dict[bytes, Any] | None = None,
    share: float = STRUCTURAL_SHARE,
) -> tuple[str, bytes]:
    """One seeded mutation of any corpus file, by what it is: a torch zip (its bytes, or with ``cache`` given,
    ``share`` of them structure-aware edits of its object), safetensors, JSON, other bytes."""
    if original[:4] == b"PK\x03\x04":
        if cache is not None and rng.random() < share:
            done = structural(original, rng, cache)
            if done is not None:
                return done
        return mutate(original, path, other, rng)
    if path.suffix == ".safetensors":
        return _safetensors_mutation(original, other, rng)
    if path.suffix == ".json":
        return _json_mutation(original, other, rng)
    return _generic(bytearray(original), other, rng)
