"""Every small record of a torch file (data.pkl, version, ...) is CRC-checked on every read, before anything is
unpickled: a changed byte that still unpickles is refused by every reader, and nothing is restored."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch

import dist_resume as dr
from dist_resume._format.archive import read_archive
from dist_resume._format.records import read_records
from dist_resume._format.small_records import read_checked_records


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return model, opt


def _change_byte(path: Path, record: str, old: bytes, new: bytes) -> None:
    """Replace ``old`` by ``new`` (same length) inside ``record``, in place, leaving the recorded CRC as it was."""
    (found,) = [r for r in read_records(path)[1] if r.name == record]
    raw = bytearray(path.read_bytes())
    data = raw[found.data_offset : found.data_offset + found.compress_size]
    at = data.find(old)
    assert at >= 0 and len(old) == len(new), (record, old)
    raw[found.data_offset + at : found.data_offset + at + len(old)] = new
    path.write_bytes(bytes(raw))


@pytest.fixture
def step_renamed(tmp_path: Path) -> Path:
    """A dist_resume checkpoint whose data.pkl has the key ``step`` renamed ``Dtep``: it still unpickles."""
    model, opt = _trained()
    folder = tmp_path / "run"
    with dr.CheckpointManager(folder) as mgr:
        path = Path(mgr.save(5, model=model, optimizer=opt))
    _change_byte(path, "archive/data.pkl", b"X\x04\x00\x00\x00step", b"X\x04\x00\x00\x00Dtep")
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() == "archive/data.pkl"  # zipfile sees the CRC mismatch ...
    obj = torch.load(path, weights_only=True)  # ... torch.load does not, and unpickles the changed key
    assert "Dtep" in obj["meta"]
    return path


def _fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, torch.Tensor]]:
    torch.manual_seed(1)
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    return model, opt, {k: v.clone() for k, v in model.state_dict().items()}


def _unchanged(model: torch.nn.Module, opt: torch.optim.Optimizer, before: dict[str, torch.Tensor]) -> None:
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not opt.state and opt.param_groups[0]["lr"] == 0.1


def test_a_changed_pickle_byte_is_refused_by_every_reader_and_nothing_changes(step_renamed: Path) -> None:
    match = r"record 'archive/data.pkl' fails its CRC-32 check \(recorded 0x[0-9a-f]{8}, data 0x[0-9a-f]{8}\)"
    for read in (
        lambda: dr.load_checkpoint(step_renamed),
        lambda: dr.load_checkpoint(step_renamed, mmap=False),
        lambda: read_archive(step_renamed),
        lambda: dr.tools.inspect_checkpoint(step_renamed, verify=False),
    ):
        with pytest.raises(dr.errors.CheckpointCorruptError, match=match) as err:
            read()
        assert str(step_renamed) in str(err.value)
    model, opt, before = _fresh()
    with pytest.raises(dr.errors.CheckpointCorruptError, match=match):
        dr.resume(step_renamed, model=model, optimizer=opt)
    _unchanged(model, opt, before)
    # the folder holds nothing else valid: the manager refuses too (never a silent fresh start)
    with pytest.raises(dr.errors.CheckpointCorruptError, match=r"archive/data.pkl.*CRC"):
        dr.CheckpointManager(step_renamed.parent).resume(model=model, optimizer=opt)
    _unchanged(model, opt, before)


@pytest.mark.parametrize(("record", "old", "new"), [("archive/version", b"3", b"2"), ("archive/byteorder", b"l", b"b")])
def test_every_small_record_is_checked_not_only_the_pickle(tmp_path: Path, record: str, old: bytes, new: bytes) -> None:
    path = tmp_path / "archive.pt"  # torch names the archive after the file
    torch.save({"w": torch.ones(2)}, path)
    read_checked_records(path)
    _change_byte(path, record, old, new)
    with pytest.raises(dr.errors.CheckpointCorruptError, match=f"record {record!r} fails its CRC-32 check"):
        dr.load_checkpoint(path)


def test_tensor_data_is_left_to_verify(tmp_path: Path) -> None:
    path = tmp_path / "archive.pt"
    torch.save({"w": torch.arange(4, dtype=torch.uint8)}, path)
    _change_byte(path, "archive/data/0", bytes([0, 1, 2, 3]), bytes([9, 1, 2, 3]))
    assert dr.load_checkpoint(path)["w"][0] == 9  # tensor bytes are not read twice on an ordinary load
    with pytest.raises(dr.errors.CheckpointCorruptError, match="archive/data/0: CRC32 mismatch"):
        dr.load_checkpoint(path, verify=True)
