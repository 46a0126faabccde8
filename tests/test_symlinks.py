"""Nothing the toolkit creates, rewrites or deletes in a folder goes through a planted symlink (or hard link).

One test per path: the folder lock, the atomic save's temporary file and its destination, a conversion's DST (file and
folder) and its stale temporary files, rotation's deletes and the cleanup of leftovers. In each, a file (or folder)
outside the checkpoint folder is the link's target, and it keeps its content.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest
import torch

import dist_resume as dr
from dist_resume._manager.lock import LOCK_NAME
from dist_resume._source.listing import checkpoint_name

PRECIOUS = b"precious: not a checkpoint\n"


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    target = tmp_path / "outside" / "precious.txt"
    target.parent.mkdir()
    target.write_bytes(PRECIOUS)
    return target


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    path = tmp_path / "ckpts"
    path.mkdir()
    return path


def _model() -> torch.nn.Module:
    return torch.nn.Linear(2, 2)


def test_a_symlinked_lock_file_is_refused_naming_it(folder: Path, outside: Path) -> None:
    (folder / LOCK_NAME).symlink_to(outside)
    mgr = dr.CheckpointManager(folder)
    with pytest.raises(
        dr.errors.CheckpointWriteError, match=r"lock file '.*\.dist_resume\.lock' is a symbolic link \(to"
    ):
        mgr.save(1, model=_model())
    assert outside.read_bytes() == PRECIOUS
    assert mgr.checkpoints() == []  # refused before anything was written
    (folder / LOCK_NAME).unlink()
    (folder / LOCK_NAME).symlink_to(outside.parent / "absent.txt")  # dangling: creating it would write outside
    with pytest.raises(dr.errors.CheckpointWriteError, match="is a symbolic link"):
        mgr.save(1, model=_model())
    assert not (outside.parent / "absent.txt").exists()


def test_a_hard_linked_or_special_lock_file_is_refused(folder: Path, outside: Path) -> None:
    os.link(outside, folder / LOCK_NAME)
    with pytest.raises(dr.errors.CheckpointWriteError, match="is a file with 2 hard links"):
        dr.CheckpointManager(folder).save(1, model=_model())
    assert outside.read_bytes() == PRECIOUS
    (folder / LOCK_NAME).unlink()
    os.mkfifo(folder / LOCK_NAME)
    with pytest.raises(dr.errors.CheckpointWriteError, match="is not a regular file"):
        dr.CheckpointManager(folder).save(1, model=_model())
    (folder / LOCK_NAME).unlink()
    with dr.CheckpointManager(folder) as mgr:  # a plain lock file again: saving works
        mgr.save(1, model=_model())


def test_a_symlink_at_the_temporary_name_is_never_opened(
    folder: Path, outside: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = iter(["0123456789abcdef", "fedcba9876543210"])
    monkeypatch.setattr(secrets, "token_hex", lambda n: next(tokens))  # the module atomic draws its names from
    dest = folder / "model.pt"
    (folder / ".model.pt.0123456789abcdef.tmp").symlink_to(outside)  # the first name it will draw
    dr.save_checkpoint(dest, model=_model(), step=1)
    assert outside.read_bytes() == PRECIOUS
    assert dr.tools.inspect_checkpoint(dest).step == 1 and not dest.is_symlink()


def test_a_symlink_at_the_destination_is_replaced_not_written_through(folder: Path, outside: Path) -> None:
    dest = folder / checkpoint_name(5)
    dest.symlink_to(outside)
    with dr.CheckpointManager(folder) as mgr:
        mgr.save(5, model=_model())
    assert outside.read_bytes() == PRECIOUS
    assert not dest.is_symlink() and dr.tools.inspect_checkpoint(dest).step == 5


def test_conversion_outputs_replace_symlinks_and_remove_linked_temps(
    tmp_path: Path, folder: Path, outside: Path
) -> None:
    src = dr.save_checkpoint(tmp_path / "src.pt", model=_model(), step=1)
    dst = folder / "out.pt"
    dst.symlink_to(outside)
    dr.tools.convert_checkpoint(src, dst, force=True)
    assert outside.read_bytes() == PRECIOUS and not dst.is_symlink()
    # a stale temporary name that is a symlink (to a file, to a folder): removed as a link
    linked_file = folder / ".out.pt.0123456789abcdef.tmp"
    linked_dir = folder / ".out.pt.fedcba9876543210.tmp"
    linked_file.symlink_to(outside)
    linked_dir.symlink_to(outside.parent)
    dr.tools.convert_checkpoint(src, dst, force=True)
    assert not os.path.lexists(linked_file) and not os.path.lexists(linked_dir)
    assert outside.read_bytes() == PRECIOUS
    # a DCP folder written over a symlink to an outside folder: the link goes, the folder stays
    dcp = folder / "dcp"
    dcp.symlink_to(outside.parent)
    dr.tools.convert_checkpoint(src, dcp, format="dcp", force=True)
    assert not dcp.is_symlink() and (dcp / ".metadata").exists()
    assert sorted(os.listdir(outside.parent)) == ["precious.txt"] and outside.read_bytes() == PRECIOUS


def test_rotation_deletes_a_symlinked_checkpoint_as_a_link(tmp_path: Path, folder: Path) -> None:
    target = dr.save_checkpoint(tmp_path / "kept_elsewhere.pt", model=_model(), step=1)
    before = target.read_bytes()
    (folder / checkpoint_name(1)).symlink_to(target)  # a valid checkpoint, linked in
    with dr.CheckpointManager(folder, keep_last=1) as mgr:
        mgr.save(2, model=_model())
    assert not os.path.lexists(folder / checkpoint_name(1))  # rotated out: the link
    assert target.read_bytes() == before  # the file it pointed to is untouched


def test_leftover_cleanup_removes_a_symlink_as_a_link(folder: Path, outside: Path) -> None:
    leftover = folder / f".{checkpoint_name(2)}.0123456789abcdef.tmp"
    leftover.symlink_to(outside)
    with dr.CheckpointManager(folder) as mgr:
        mgr.save(3, model=_model())
    assert not os.path.lexists(leftover) and outside.read_bytes() == PRECIOUS
