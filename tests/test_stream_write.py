"""dist_resume._format.stream_write: one torch zip checkpoint written tensor by tensor, as torch.save writes it."""

from __future__ import annotations

import os
import zipfile
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_resume import load_checkpoint
from dist_resume._format.archive import read_archive
from dist_resume._format.stream_write import distinct_tensors, write_streamed
from dist_resume._format.zip_verify import verify_zip
from dist_resume.errors import CheckpointWriteError


def _sample() -> dict[str, Any]:
    tied = torch.randn(3, 4)
    return {
        "model": OrderedDict(
            w=tied,
            tied=tied,
            ids=torch.arange(5),
            half=torch.randn(2, dtype=torch.bfloat16),
            u16=torch.arange(3).to(torch.uint16),  # no typed storage class: saved untyped, as torch does
            empty=torch.empty(0, 3),
        ),
        "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(3, 4)}}, "param_groups": []},
        "meta": {"step": 7, "name": "run", "pair": (1, 2.5), "none": None},
    }


def _write(path: Path, obj: Any, pieces: Any = None) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        return write_streamed(fd, obj, pieces)
    finally:
        os.close(fd)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def test_the_file_is_torch_saves_byte_for_byte_but_its_serialization_id(tmp_path: Path) -> None:
    obj = _sample()
    size = _write(tmp_path / "archive.pt", obj)  # torch.save names the archive after the file: "archive"
    (tmp_path / "ref").mkdir()
    torch.save(obj, tmp_path / "ref" / "archive.pt")
    ours, theirs = (tmp_path / "archive.pt").read_bytes(), (tmp_path / "ref" / "archive.pt").read_bytes()
    assert size == len(ours) == len(theirs)
    with zipfile.ZipFile(tmp_path / "archive.pt") as za, zipfile.ZipFile(tmp_path / "ref" / "archive.pt") as zb:
        names = [i.filename for i in za.infolist()]
        assert names == [i.filename for i in zb.infolist()]
        assert names[:4] == [
            "archive/data.pkl",
            "archive/.format_version",
            "archive/.storage_alignment",
            "archive/byteorder",
        ]
        assert names[-2:] == ["archive/version", "archive/.data/serialization_id"]
        for a, b in zip(za.infolist(), zb.infolist()):
            assert (a.header_offset, a.extra, a.flag_bits, a.file_size) == (
                b.header_offset,
                b.extra,
                b.flag_bits,
                b.file_size,
            )
            if not a.filename.endswith("serialization_id"):
                assert za.read(a) == zb.read(b) and a.CRC == b.CRC, a.filename
        assert za.testzip() is None  # every CRC-32 checks
    differing = sum(x != y for x, y in zip(ours, theirs))
    # the 40-byte id and its CRC-32, wherever the zip writer repeats it (local header, data descriptor, directory):
    # 49 differing bytes were seen once, more than the id and two CRC copies
    assert 0 < differing <= 40 + 3 * 4


def test_it_loads_everywhere_as_the_state_it_was_given(tmp_path: Path) -> None:
    obj = _sample()
    _write(tmp_path / "s.pt", obj)
    for loaded in (
        torch.load(tmp_path / "s.pt", weights_only=True),
        torch.load(tmp_path / "s.pt", weights_only=True, mmap=True),
        load_checkpoint(tmp_path / "s.pt", map_location="cpu"),
    ):
        assert _same(loaded, obj)
        assert loaded["model"]["w"] is loaded["model"]["tied"]  # one record for a tensor reachable twice
    verify_zip(tmp_path / "s.pt")
    contents = read_archive(tmp_path / "s.pt")
    assert len(contents.storages) == len(distinct_tensors(obj)) == 7


def test_tensors_come_piece_by_piece_and_each_piece_is_written_before_the_next_is_asked_for(tmp_path: Path) -> None:
    big = torch.randn(1000, 7)
    obj = {"big": big, "small": torch.ones(3), "t": big.t()}  # a non-contiguous view becomes its own record
    path = tmp_path / "s.pt"
    asked: list[tuple[int, int]] = []

    def pieces(i: int, tensor: torch.Tensor) -> Iterable[torch.Tensor]:
        flat = tensor.contiguous().reshape(-1)
        for start in range(0, flat.numel(), 999):
            asked.append((i, path.stat().st_size))
            yield flat[start : start + 999].clone()

    _write(path, obj, pieces)
    assert [i for i, _ in asked] == [0] * 8 + [1] + [2] * 8
    sizes = [size for _, size in asked]
    assert sizes == sorted(sizes) and sizes[1] > sizes[0]  # the file grew between two asks
    loaded = torch.load(path, weights_only=True)
    assert _same(loaded, {"big": big, "small": torch.ones(3), "t": big.t().contiguous()})


@pytest.mark.parametrize("extra", [-1, 1])
def test_pieces_that_do_not_add_up_raise(tmp_path: Path, extra: int) -> None:
    def pieces(i: int, tensor: torch.Tensor) -> Iterable[torch.Tensor]:
        yield torch.zeros(tensor.numel() + extra)

    with pytest.raises(
        CheckpointWriteError, match=r"tensor 0 of the checkpoint \(\(2, 2\), torch.float32\) should hold 16"
    ):
        _write(tmp_path / "s.pt", {"w": torch.ones(2, 2)}, pieces)
