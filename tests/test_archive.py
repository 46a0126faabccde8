"""dist_resume._archive / _archive_write: a checkpoint's structure without its data, and a byte-exact rewrite."""

from __future__ import annotations

import fractions
import os
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_resume import load_checkpoint
from dist_resume._convert import archive_write as _archive_write
from dist_resume._convert.archive_write import rewrite_archive
from dist_resume._format.archive import read_archive
from dist_resume._format.pickle_write import dump_pickle
from dist_resume._format.records import read_records
from dist_resume._format.zip_verify import FindingKind
from dist_resume.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    NotACheckpointError,
    UnsafeCheckpointError,
)
from dist_resume.tools import verify_archive
from tests.helpers import save_with_device_tag


def _sample() -> dict[str, Any]:
    base = torch.randn(10)
    return {
        "transposed": torch.arange(6.0).reshape(2, 3).t(),
        "param": torch.nn.Parameter(torch.randn(2, 2)),
        "view": base[2:5],
        "base": base,
        "empty": torch.empty(0),
        "scalar": torch.tensor(3.5),
        "bf16": torch.randn(3, dtype=torch.bfloat16),
        "bool": torch.tensor([True, False]),
        "complex": torch.randn(2, dtype=torch.complex64),
        "int64": torch.arange(5),
        "fp8": torch.randn(4).to(torch.float8_e4m3fn),
        "uint16": torch.tensor([1, 2, 3]).to(torch.uint16),
        "grad": torch.ones(2, requires_grad=True),
        "meta": torch.empty(3, device="meta"),
        "plain": [1, 2.5, "x", b"bytes", (1, 2), {3}, torch.float16, torch.device("cuda:1"), torch.Size([2])],
    }


def _rewrite(src: Path, dst: Path, obj: Any = None) -> None:
    contents = read_archive(src)
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        rewrite_archive(contents, dump_pickle(contents.obj if obj is None else obj, contents), fd)
    finally:
        os.close(fd)


def _assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert a.requires_grad == b.requires_grad
        if not a.is_meta:
            assert torch.equal(
                a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b,
            )
    else:
        assert a == b


def test_structure_is_read_without_tensor_data(tmp_path: Path) -> None:
    obj = _sample()
    torch.save(obj, tmp_path / "a.pt")
    # overwrite every data record with other bytes: reading the structure must not notice
    _, records = read_records(tmp_path / "a.pt")
    with open(tmp_path / "a.pt", "r+b") as f:
        for r in records:
            if "/data/" in r.name and r.file_size:
                f.seek(r.data_offset)
                f.write(b"\xa5" * r.file_size)
    contents = read_archive(tmp_path / "a.pt")
    for key, value in obj.items():
        got = contents.obj[key]
        if isinstance(value, torch.Tensor):
            assert got.is_meta and got.shape == value.shape and got.dtype == value.dtype
            assert got.stride() == value.stride() and type(got) is type(value)
        else:
            assert got == value
    info = contents.storage_of(contents.obj["view"])
    assert info is not None and info is contents.storage_of(contents.obj["base"])  # views keep sharing
    assert (info.location, info.nbytes, info.dtype) == ("cpu", 40, torch.float32)
    assert contents.storage_of(contents.obj["meta"]) is None  # saved without storage


@pytest.mark.parametrize("mmap", [False, True])
def test_rewrite_round_trip_loads_with_plain_torch(tmp_path: Path, mmap: bool) -> None:
    obj = _sample()
    torch.save(obj, tmp_path / "a.pt")
    _rewrite(tmp_path / "a.pt", tmp_path / "b.pt")
    loaded = torch.load(tmp_path / "b.pt", weights_only=True, mmap=mmap)
    assert list(loaded) == list(obj)
    for key in obj:
        _assert_same(obj[key], loaded[key])
    assert loaded["view"].untyped_storage().data_ptr() == loaded["base"].untyped_storage().data_ptr()


def test_rewrite_keeps_records_byte_for_byte_and_torchs_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.save(_sample(), tmp_path / "a.pt")
    _rewrite(tmp_path / "a.pt", tmp_path / "b.pt")
    with zipfile.ZipFile(tmp_path / "a.pt") as za, zipfile.ZipFile(tmp_path / "b.pt") as zb:
        a_infos, b_infos = za.infolist(), zb.infolist()
        assert [i.filename for i in a_infos] == [i.filename for i in b_infos]
        for ia, ib in zip(a_infos, b_infos):
            if not ia.filename.endswith("data.pkl"):
                assert za.read(ia) == zb.read(ib) and ia.CRC == ib.CRC
    _, records = read_records(tmp_path / "b.pt")
    assert all(r.data_offset % 64 == 0 for r in records)  # torch's storage alignment, needed for mmap
    assert verify_archive(tmp_path / "b.pt") == []
    # torch computes storage offsets itself from miniz's layout; the debug mode asserts they are right
    from torch.utils.serialization import config

    monkeypatch.setenv("TORCH_SERIALIZATION_DEBUG", "1")
    # config.patch, not monkeypatch.setattr: undoing the latter leaves the option hidden for later tests
    with config.patch({"load.calculate_storage_offsets": True}):  # type: ignore[attr-defined]  # not in the stubs
        loaded = torch.load(tmp_path / "b.pt", weights_only=True, mmap=True)
        assert torch.equal(loaded["base"], torch.load(tmp_path / "a.pt", weights_only=True)["base"])
        torch.load(tmp_path / "b.pt", weights_only=True, map_location="meta")


def test_zip64_layout_matches_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A > 4 GiB record and records past 4 GiB: zip64 fields and data descriptors exactly where torch expects them.

    The source is written with skip_data from a FakeTensor (a sparse file, no memory) and the big record
    is left as a hole in the copy.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        big = torch.empty(int(4.3e9), dtype=torch.uint8)
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(
            {"a": torch.zeros(5), "big": big, "b": torch.zeros(7), "p": torch.nn.Parameter(torch.zeros(3))},
            tmp_path / "a.pt",
        )
    copy = _archive_write._copy_range  # type: ignore[attr-defined]  # an alias kept for tests to patch

    def sparse_copy(src: int, dst: int, src_offset: int, dst_offset: int, count: int) -> None:
        if count < 1 << 30:
            copy(src, dst, src_offset, dst_offset, count)

    monkeypatch.setattr(_archive_write, "_copy_range", sparse_copy)
    monkeypatch.setattr(_archive_write, "_COPY_CHUNK", 8 << 30)
    contents = read_archive(tmp_path / "a.pt")
    renamed = {f"module.{k}": v for k, v in contents.obj.items()}
    _rewrite(tmp_path / "a.pt", tmp_path / "b.pt", renamed)
    from torch.utils.serialization import config

    monkeypatch.setenv("TORCH_SERIALIZATION_DEBUG", "1")
    with config.patch({"load.calculate_storage_offsets": True}):  # type: ignore[attr-defined]  # not in the stubs
        loaded = torch.load(tmp_path / "b.pt", weights_only=True, mmap=True)
    assert list(loaded) == ["module.a", "module.big", "module.b", "module.p"]
    assert loaded["module.big"].shape == (int(4.3e9),) and loaded["module.b"].shape == (7,)
    _, records = read_records(tmp_path / "b.pt")
    assert records[-1].header_offset > 0xFFFFFFFF and all(r.data_offset % 64 == 0 for r in records)


def test_device_tags_are_read_and_kept(tmp_path: Path) -> None:
    save_with_device_tag({"w": torch.ones(2), "b": torch.zeros(1)}, tmp_path / "gpu.pt", "cuda:3")
    contents = read_archive(tmp_path / "gpu.pt")
    assert {s.location for s in contents.storages.values()} == {"cuda:3"}
    _rewrite(tmp_path / "gpu.pt", tmp_path / "out.pt")
    assert {s.location for s in read_archive(tmp_path / "out.pt").storages.values()} == {"cuda:3"}
    loaded = torch.load(tmp_path / "out.pt", weights_only=True, map_location="cpu")
    assert torch.equal(loaded["w"], torch.ones(2))


class _RunsCode:
    def __init__(self, call: Callable[..., Any], arg: str) -> None:
        self.call, self.arg = call, arg

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.call, (self.arg,))


@pytest.mark.parametrize("how", ["os.system", "exec"])
def test_pickle_that_would_run_code_is_refused_before_it_runs(tmp_path: Path, how: str) -> None:
    marker = tmp_path / "marker"
    payload = (
        _RunsCode(os.system, f"touch {marker}")
        if how == "os.system"
        else _RunsCode(exec, f"open({str(marker)!r}, 'w').close()")
    )
    torch.save({"w": torch.ones(1), "evil": payload}, tmp_path / "evil.pt")
    with pytest.raises(UnsafeCheckpointError) as info:
        read_archive(tmp_path / "evil.pt")
    assert ("system" if how == "os.system" else "exec") in str(info.value)
    assert "evil.pt" in str(info.value)
    assert not marker.exists()


@pytest.mark.parametrize("how", ["fractions.Fraction", "os.system", "exec"])
def test_read_archive_and_load_checkpoint_refuse_in_the_same_words(tmp_path: Path, how: str) -> None:
    marker = tmp_path / "marker"
    payload = {
        "fractions.Fraction": fractions.Fraction(1, 3),  # argparse.Namespace is allowed: see test_resume_options
        "os.system": _RunsCode(os.system, f"touch {marker}"),
        "exec": _RunsCode(exec, f"open({str(marker)!r}, 'w').close()"),
    }[how]
    torch.save({"w": torch.ones(1), "extra": payload}, tmp_path / "x.pt")
    with pytest.raises(UnsafeCheckpointError) as by_archive:
        read_archive(tmp_path / "x.pt")
    with pytest.raises(UnsafeCheckpointError) as by_load:
        load_checkpoint(tmp_path / "x.pt", map_location="cpu")
    assert str(by_archive.value) == str(by_load.value)
    assert how.rpartition(".")[2] in str(by_load.value) and not marker.exists()


def test_verify_archive_finds_a_flipped_byte(tmp_path: Path) -> None:
    torch.save({"w": torch.randn(100)}, tmp_path / "a.pt")
    assert verify_archive(tmp_path / "a.pt") == []
    _, records = read_records(tmp_path / "a.pt")
    target = next(r for r in records if r.name.endswith("/data/0"))
    with open(tmp_path / "a.pt", "r+b") as f:
        f.seek(target.data_offset + 17)
        byte = f.read(1)
        f.seek(target.data_offset + 17)
        f.write(bytes([byte[0] ^ 0x01]))
    torch.load(tmp_path / "a.pt", weights_only=True)  # torch itself does not notice
    findings = verify_archive(tmp_path / "a.pt", strict=False)
    assert [f.record for f in findings] == [target.name] and "CRC32 mismatch" in findings[0].problem
    assert findings[0].kind is FindingKind.CRC_MISMATCH
    with pytest.raises(CheckpointCorruptError, match="data/0: CRC32 mismatch"):
        verify_archive(tmp_path / "a.pt")


def test_verify_archive_reports_truncation_and_reports_progress(tmp_path: Path) -> None:
    torch.save({"w": torch.randn(1000)}, tmp_path / "a.pt")
    seen: list[tuple[int, int]] = []
    verify_archive(tmp_path / "a.pt", progress=lambda done, total: seen.append((done, total)))
    assert seen and seen[-1][0] == seen[-1][1]
    data = (tmp_path / "a.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    findings = verify_archive(tmp_path / "cut.pt", strict=False)
    assert len(findings) == 1 and "truncated" in str(findings[0]) and findings[0].kind is FindingKind.UNREADABLE
    with pytest.raises(CheckpointCorruptError):
        verify_archive(tmp_path / "cut.pt")


@pytest.mark.parametrize("kind", ["missing", "empty", "truncated", "text", "zip", "legacy"])
def test_bad_inputs_raise_checkpoint_errors(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "bad.pt"
    expected: type[Exception] = NotACheckpointError
    if kind == "missing":
        expected = CheckpointNotFoundError
    elif kind == "empty":
        path.write_bytes(b"")
        expected = CheckpointCorruptError
    elif kind == "truncated":
        torch.save({"w": torch.randn(1000)}, path)
        path.write_bytes(path.read_bytes()[:3000])
        expected = CheckpointCorruptError
    elif kind == "text":
        path.write_text("not a checkpoint\n")
    elif kind == "zip":
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr("notes.txt", "hello")
    else:
        torch.save({"w": torch.ones(2)}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(expected) as info:
        read_archive(path)
    assert "bad.pt" in str(info.value)


# ---------------------------------------------------------------- hostile directories (issue 12)

_CENTRAL = 0x02014B50


def _central_entries(data: bytes) -> list[int]:
    """Offsets of the central-directory headers of a zip file."""
    out, at = [], data.find(_CENTRAL.to_bytes(4, "little"))
    while at >= 0:
        out.append(at)
        at = data.find(_CENTRAL.to_bytes(4, "little"), at + 46)
    return out


def _damaged(tmp_path: Path, field_offset: int, value: bytes, record: str = "data.pkl") -> Path:
    """A real checkpoint whose central-directory entry for ``record`` has ``value`` at ``field_offset``."""
    good = tmp_path / "good.pt"
    torch.save({"w": torch.randn(100), "n": 3}, good)
    data = bytearray(good.read_bytes())
    for at in _central_entries(bytes(data)):
        name_len = int.from_bytes(data[at + 28 : at + 30], "little")
        if bytes(data[at + 46 : at + 46 + name_len]).endswith(record.encode()):
            data[at + field_offset : at + field_offset + len(value)] = value
            break
    else:
        raise AssertionError(f"no central entry for {record}")
    bad = tmp_path / "bad.pt"
    bad.write_bytes(bytes(data))
    return bad


@pytest.mark.parametrize(
    ("what", "field_offset", "value", "record"),
    [
        ("uncompressed size 0xFFFFFFFF", 24, b"\xff\xff\xff\xff", "data/0"),
        ("compressed size 0xFFFFFFFF", 20, b"\xff\xff\xff\xff", "data/0"),
        ("header offset past the end", 42, b"\xff\xff\xff\x7f", "data/0"),
        ("compression method 99", 10, b"\x63\x00", "data.pkl"),
        ("name flagged UTF-8 that is not", 8, b"\x00\x08", "byteorder"),
    ],
)
def test_a_damaged_directory_is_refused_before_torchs_reader_sees_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, what: str, field_offset: int, value: bytes, record: str
) -> None:
    bad = _damaged(tmp_path, field_offset, value, record)
    if "UTF-8" in what:  # make the flagged name invalid UTF-8 in the directory
        data = bytearray(bad.read_bytes())
        at = bytes(data).find(b"byteorder", _central_entries(bytes(data))[0])
        data[at] = 0xFF
        bad.write_bytes(bytes(data))

    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("torch.load was handed a damaged archive")

    monkeypatch.setattr(torch, "load", never)
    for read in (read_records, read_archive, load_checkpoint):
        with pytest.raises(CheckpointCorruptError, match=r"bad\.pt.*damaged") as info:
            read(bad)
        assert "resume from an earlier checkpoint" in str(info.value)
    findings = verify_archive(bad, strict=False)
    assert [f.kind for f in findings] == [FindingKind.UNREADABLE], findings


def test_a_local_header_naming_another_record_is_refused(tmp_path: Path) -> None:
    good = tmp_path / "good.pt"
    torch.save({"w": torch.ones(3)}, good)
    data = bytearray(good.read_bytes())
    at = bytes(data).find(b"good/byteorder")  # the first occurrence is the local header's copy
    assert 0 < at < len(data) // 2
    data[at + len("good/")] = ord("B")
    bad = tmp_path / "bad.pt"
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match="another name in its local header"):
        read_records(bad)


def test_read_archive_runs_the_security_check_before_unpickling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dist_resume._core import security
    from dist_resume.errors import TorchSecurityWarning

    torch.save({"w": torch.ones(2)}, tmp_path / "a.pt")
    monkeypatch.setattr(security, "_warned", False)
    monkeypatch.setattr(torch, "__version__", "2.9.1")
    with pytest.warns(TorchSecurityWarning, match="CVE-2026-24747"):
        read_archive(tmp_path / "a.pt")
