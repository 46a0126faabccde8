"""The fuzz corpus (files this toolkit writes and the foreign layouts resume reads) and the mutations."""

from __future__ import annotations

import random
import shutil
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

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
    """Write the seed files; return name -> path (a folder for ``manager``)."""
    import dist_resume as dr

    folder.mkdir(parents=True, exist_ok=True)
    model, opt, sched, scaler = trained()
    out: dict[str, Path] = {}
    out["own"] = dr.save_checkpoint(
        folder / "own.pt", model=model, optimizer=opt, scheduler=sched, scaler=scaler, step=7, epoch=1, rng=True
    )
    for name, obj in (
        ("bare", model.state_dict()),
        ("model_optimizer", {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 1}),
        ("state_dict", {"state_dict": model.state_dict()}),
        (
            "model_state_dict",
            {"model_state_dict": model.state_dict(), "optimizer_state_dict": opt.state_dict(), "epoch": 1},
        ),
    ):
        torch.save(obj, folder / f"{name}.pt")
        out[name] = folder / f"{name}.pt"
    manager = folder / "manager"
    if manager.exists():
        shutil.rmtree(manager)
    with dr.CheckpointManager(manager, keep_last=2) as mgr:
        for step in (1, 2):
            mgr.save(step, model=model, optimizer=opt, scheduler=sched, scaler=scaler)
    out["manager"] = manager
    return out


RESTORES = {
    "own": ("model", "optimizer", "scheduler", "scaler"),
    "manager": ("model", "optimizer", "scheduler", "scaler"),
    "model_optimizer": ("model", "optimizer"),
    "model_state_dict": ("model", "optimizer"),
    "bare": ("model",),
    "state_dict": ("model",),
}
"""What resume is given for each corpus file: what the unmutated file holds (so it succeeds)."""


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
