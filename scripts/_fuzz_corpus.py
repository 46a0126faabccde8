"""The fuzz corpus (files this toolkit writes and the foreign layouts resume reads) and the mutations."""

from __future__ import annotations

import copy
import json
import random
import shutil
import struct
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn


class Net(nn.Module):
    """The model every corpus file holds (and every resume case restores into)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)


def trained() -> tuple[Net, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler, torch.amp.GradScaler]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    model.fc2(model.fc1(torch.ones(3, 8))).sum().backward()
    opt.step()
    sched.step()
    return model, opt, sched, scaler


def build_corpus(folder: Path) -> dict[str, Path]:
    """Write the seed files; return name -> path (a folder for ``manager`` and the foreign folders)."""
    import dist_resume as dr

    folder.mkdir(parents=True, exist_ok=True)
    model, opt, sched, scaler = trained()
    sd, osd = model.state_dict(), opt.state_dict()
    out: dict[str, Path] = {}
    out["own"] = dr.save_checkpoint(
        folder / "own.pt", model=model, optimizer=opt, scheduler=sched, scaler=scaler, step=7, epoch=1, rng=True
    )
    lightning = {  # the keys a Lightning Trainer writes (a LightningModule whose layers are fc1 and fc2)
        "epoch": 1,
        "global_step": 3,
        "pytorch-lightning_version": "2.4.0",
        "state_dict": sd,
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"current": {"completed": 1}}}},
        "callbacks": {},
        "optimizer_states": [osd],
        "lr_schedulers": [sched.state_dict()],
        "hparams_name": "kwargs",
        "hyper_parameters": {"lr": 0.1},
    }
    for name, obj, suffix in (
        ("bare", sd, ".pt"),
        ("model_optimizer", {"model": sd, "optimizer": osd, "epoch": 1}, ".pt"),
        ("state_dict", {"state_dict": sd}, ".pt"),
        ("model_state_dict", {"model_state_dict": sd, "optimizer_state_dict": osd, "epoch": 1}, ".pt"),
        ("lightning", lightning, ".ckpt"),
        ("snapshot", {"MODEL_STATE": sd, "EPOCHS_RUN": 3}, ".pt"),  # the PyTorch DDP tutorial's snapshot
        # a hand-written script's names, one level down, with a loss history beside them: detection by content
        (
            "free_named",
            {
                "state": {"net": sd, "opt": osd, "sched": sched.state_dict()},
                "it": 3,
                "history": [[0.5, 0.4], {"lr": [0.1]}],
            },
            ".pt",
        ),
    ):
        torch.save(obj, folder / f"{name}{suffix}")
        out[name] = folder / f"{name}{suffix}"
    out["safetensors"] = _safetensors(folder / "bare.pt", folder / "model.safetensors")
    out["hf"] = _hf_trainer(folder / "checkpoint-3", sd, osd, sched.state_dict())
    out["hf_sharded"] = _hf_sharded(folder / "sharded" / "checkpoint-3", sd)
    out["accelerate"] = _accelerate(folder / "accelerate", sd, osd, sched.state_dict())
    out["dcp"] = _dcp(folder / "dcp", sd, osd)
    manager = folder / "manager"
    if manager.exists():
        shutil.rmtree(manager)
    with dr.CheckpointManager(manager, keep_last=2) as mgr:
        for step in (1, 2):
            mgr.save(step, model=model, optimizer=opt, scheduler=sched, scaler=scaler)
    out["manager"] = manager
    return out


def _safetensors(src: Path, dst: Path) -> Path:
    """A ``.safetensors`` file written by dist_resume's own writer (the safetensors package is not needed)."""
    import dist_resume as dr

    dr.tools.convert_checkpoint(src, dst, format="safetensors", force=True)
    return dst


def _fresh(folder: Path) -> Path:
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    return folder


def _trainer_state(folder: Path) -> None:
    state = {"global_step": 3, "epoch": 1.0, "max_steps": 10, "log_history": [{"loss": 0.5, "step": 3}]}
    (folder / "trainer_state.json").write_text(json.dumps(state))


def _hf_trainer(folder: Path, sd: dict[str, Any], osd: dict[str, Any], ssd: dict[str, Any]) -> Path:
    """The files of an HF Trainer ``checkpoint-N/``, written here: running the real transformers Trainer
    would take seconds per corpus build and pull a large dependency into the fuzz run."""
    _fresh(folder)
    torch.save(sd, folder / "weights.pt")
    _safetensors(folder / "weights.pt", folder / "model.safetensors")
    (folder / "weights.pt").unlink()
    torch.save(osd, folder / "optimizer.pt")
    torch.save(ssd, folder / "scheduler.pt")
    _trainer_state(folder)
    return folder


def _hf_sharded(folder: Path, sd: dict[str, Any]) -> Path:
    """An HF Trainer checkpoint whose weights are two safetensors shards and their index."""
    _fresh(folder)
    keys = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": keys[:2], "model-00002-of-00002.safetensors": keys[2:]}
    weight_map: dict[str, str] = {}
    for shard, names in shards.items():
        torch.save({k: sd[k] for k in names}, folder / "part.pt")
        _safetensors(folder / "part.pt", folder / shard)
        weight_map.update(dict.fromkeys(names, shard))
    (folder / "part.pt").unlink()
    total = sum(t.numel() * t.element_size() for t in sd.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    _trainer_state(folder)
    return folder


def _accelerate(folder: Path, sd: dict[str, Any], osd: dict[str, Any], ssd: dict[str, Any]) -> Path:
    """The files of an Accelerate ``save_state`` folder (one model, one optimizer, one scheduler)."""
    _fresh(folder)
    torch.save(sd, folder / "weights.pt")
    _safetensors(folder / "weights.pt", folder / "model.safetensors")
    (folder / "weights.pt").unlink()
    torch.save(osd, folder / "optimizer.bin")
    torch.save(ssd, folder / "scheduler.bin")
    return folder


def _dcp(folder: Path, sd: dict[str, Any], osd: dict[str, Any]) -> Path:
    """A torch.distributed.checkpoint folder of ``{"model", "optim"}``, saved without a process group."""
    import torch.distributed.checkpoint as dcp

    _fresh(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": sd, "optim": osd}, checkpoint_id=str(folder), no_dist=True)
    return folder


RESTORES = {
    "own": ("model", "optimizer", "scheduler", "scaler"),
    "manager": ("model", "optimizer", "scheduler", "scaler"),
    "model_optimizer": ("model", "optimizer"),
    "model_state_dict": ("model", "optimizer"),
    "bare": ("model",),
    "state_dict": ("model",),
    "lightning": ("model", "optimizer", "scheduler"),
    "snapshot": ("model",),
    "free_named": ("model", "optimizer", "scheduler"),
    "safetensors": ("model",),
    "hf": ("model", "optimizer", "scheduler"),
    "hf_sharded": ("model",),
    "accelerate": ("model", "optimizer", "scheduler"),
    "dcp": ("model", "optimizer"),
}
"""What resume is given for each corpus item: what the unmutated item holds (so it succeeds)."""


def newest_file(folder: Path) -> Path:
    """The file a folder case mutates: its newest checkpoint."""
    return sorted(p for p in folder.iterdir() if p.name.startswith("ckpt_"))[-1]


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


def members(folder: Path) -> list[str]:
    """The files of a folder corpus item a case may mutate or delete (a manager folder: its newest checkpoint)."""
    if any(p.name.startswith("ckpt_") for p in folder.iterdir()):
        return [newest_file(folder).name]
    return sorted(p.name for p in folder.iterdir() if p.is_file())


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


_ODD_VALUES: tuple[Any, ...] = (None, -1, 0, 2**63, 2**64 + 1, 1e308, "x", "", [], {}, [1, 2], {"a": 1}, True, "F64")


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
    return rng.choice(_ODD_VALUES)


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
    original: bytes, path: Path, other: bytes, rng: random.Random, cache: dict[bytes, Any] | None = None
) -> tuple[str, bytes]:
    """One seeded mutation of any corpus file, by what it is: a torch zip (its bytes, or with ``cache`` given, a
    share of structure-aware edits of its object), safetensors, JSON, other bytes."""
    if original[:4] == b"PK\x03\x04":
        if cache is not None and rng.random() < STRUCTURAL_SHARE:
            done = structural(original, rng, cache)
            if done is not None:
                return done
        return mutate(original, path, other, rng)
    if path.suffix == ".safetensors":
        return _safetensors_mutation(original, other, rng)
    if path.suffix == ".json":
        return _json_mutation(original, other, rng)
    return _generic(bytearray(original), other, rng)


# ------------------------------------------------ structure-aware mutations: load the object, change it, torch.save


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
    """Change one entry of ``obj`` in place; the kind of change made."""
    nodes = _nodes(obj)
    tensors = [n for n in nodes if isinstance(n[0][n[1]], torch.Tensor)]
    if not nodes:
        return "none"
    kind = rng.choice(("rename", "drop", "retype", "shape", "shape", "dtype", "dtype", "nest", "flatten"))
    if kind in ("shape", "dtype") and tensors:
        parent, key, _ = rng.choice(tensors)
        t = parent[key]
        parent[key] = _reshaped(t, rng) if kind == "shape" else t.to(rng.choice([d for d in _DTYPES if d != t.dtype]))
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
        parent[key] = copy.deepcopy(rng.choice((*_ODD_VALUES, like, str(value)[:20])))  # never the shared ones
    return f"struct-{kind}"


def structural(original: bytes, rng: random.Random, cache: dict[bytes, Any]) -> tuple[str, bytes] | None:
    """One structure-aware mutation of a torch file (loaded once per original, kept in ``cache``): a key renamed,
    dropped or retyped inside the pickled object, a state tensor's shape or dtype changed, an entry nested in a
    new container or replaced by one of its own entries; re-saved with torch.save. None for a file it cannot load."""
    import io

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
