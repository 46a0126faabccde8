"""A disk that is really full: a 2 MiB tmpfs mounted by the test (root only, skipped elsewhere).

Every writer must fail with :class:`CheckpointWriteError` (ENOSPC named), keep the previous file
byte for byte and leave no temporary file. The file-size-limit variant (RLIMIT_FSIZE, no root
needed) is in tests/test_faults.py.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import dist_resume as dr
from dist_resume._manager.lock import LOCK_NAME

SIZE = "2m"


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A folder on a fresh 2 MiB tmpfs, unmounted afterwards."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    try:
        out = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={SIZE},mode=0777", "tmpfs", str(mount)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        pytest.skip(f"cannot run mount: {err}")
    if out.returncode != 0:
        pytest.skip(f"mounting a tmpfs was refused: {out.stderr.strip() or out.returncode}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=30, check=False)


def _big() -> nn.Module:
    return nn.Linear(1024, 1024)  # 4 MiB of float32: more than the whole disk


def _small(value: float) -> nn.Module:
    model = nn.Linear(8, 8)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def _listing(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder)) if name != LOCK_NAME}


def _assert_refused(err: BaseException, dest: Path) -> None:
    assert isinstance(err, dr.errors.CheckpointWriteError), f"{type(err).__name__}: {err}"
    message = str(err)
    assert "disk is full" in message and "ENOSPC" in message and str(dest) in message, message
    assert "previous checkpoint (if any) is untouched" in message, message


def _check(folder: Path, dest: Path, save: Callable[[], object]) -> None:
    before = _listing(folder)
    with pytest.raises(dr.errors.CheckpointWriteError) as info:
        save()
    _assert_refused(info.value, dest)
    assert _listing(folder) == before  # the previous file byte for byte, no temporary file, no partial dest


def test_save_checkpoint_on_a_full_disk(full_disk: Path) -> None:
    dest = full_disk / "ckpt.pt"
    dr.save_checkpoint(dest, model=_small(1.0), step=1)
    _check(full_disk, dest, lambda: dr.save_checkpoint(dest, model=_big(), step=2))
    assert dr.resume(dest, model=_small(0.0), options=dr.ResumeOptions(rng=False)).step == 1


def test_save_checkpoint_async_on_a_full_disk(full_disk: Path) -> None:
    dest = full_disk / "ckpt.pt"
    dr.save_checkpoint(dest, model=_small(1.0), step=1)
    _check(full_disk, dest, lambda: dr.save_checkpoint_async(dest, model=_big(), step=2).wait())


@pytest.mark.parametrize("mode", ["save", "save_async"])
def test_checkpoint_manager_on_a_full_disk(full_disk: Path, mode: str) -> None:
    with dr.CheckpointManager(full_disk, keep_last=1) as mgr:
        good = mgr.save(1, model=_small(1.0))
        dest = full_disk / "ckpt_00000002.pt"
        if mode == "save":
            _check(full_disk, dest, lambda: mgr.save(2, model=_big()))
        else:
            _check(full_disk, dest, lambda: mgr.save_async(2, model=_big()).wait())
        assert mgr.latest() == good and mgr.checkpoints() == [good]  # keep_last=1 rotated nothing
        assert mgr.save(3, model=_small(3.0)).exists()  # space is back: the next save works


def test_convert_checkpoint_on_a_full_disk(tmp_path: Path, full_disk: Path) -> None:
    src = tmp_path / "big.pt"
    torch.save(_big().state_dict(), src)
    dst = full_disk / "ddp.pt"
    torch.save(_small(1.0).state_dict(), dst)
    _check(full_disk, dst, lambda: dr.tools.convert_checkpoint(src, dst, dr.tools.KeyForm.DDP, force=True))
