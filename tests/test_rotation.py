"""Rotation beside damage, and readers racing a writer.

Rotation never trades a valid fallback for a damaged checkpoint: what it keeps is known sound, every CRC-32 included
(the new checkpoint read back once after its write, in the background for ``save_async``; an older one the first
time rotation keeps it), and a damaged one neither counts nor is deleted. A reader (an eval job) listing and
resuming a folder while training saves and rotates into it never sees a raw error, and never calls it damaged; one
that chose a checkpoint (``latest_checkpoint``) and reads it by path after a rotation removed it gets
``CheckpointNotFoundError`` saying so, at whichever step of the read the file went away.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dist_resume as dr
from dist_resume._format import records, small_records, sniff, zip_verify
from dist_resume._manager.rotation import rotate_out
from dist_resume._source import checked, listing
from dist_resume.cli._list import list_folder
from dist_resume.errors import CheckpointNotFoundError, DistResumeError
from tests.dist.consensus_workers import filled
from tests.helpers import flip_byte_in_tensor_record


def _as_folder(path: Path) -> Path:
    """The file's checkpoint as a sharded folder ``ckpt_<step>.dcp`` beside it (the file removed)."""
    folder = Path(dr.tools.convert_checkpoint(path, path.with_suffix(".dcp"), format="sharded").dst)
    path.unlink()
    return folder


@pytest.mark.parametrize("form", ["file", "folder"])
@pytest.mark.parametrize("restarted", [False, True])
def test_a_damaged_newest_checkpoint_is_kept_aside_and_the_fallback_kept(
    tmp_path: Path, form: str, restarted: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The issue's case: valid 10 and 20, a newest 30 with one flipped byte (same size); save(40) with keep_last=2
    keeps 40 and 20 (a valid fallback), leaves 30 in place and names it, deletes 10. ``restarted``: a new process
    (nothing remembered) with 30's modification time put back, so that only its CRC-32 check can tell."""
    with dr.CheckpointManager(tmp_path, keep_last=3) as mgr:
        paths = [Path(mgr.save(step, model=filled(step))) for step in (10, 20, 30)]
    if form == "folder":
        paths = [_as_folder(p) for p in paths]
    damaged = paths[-1] / "__0_0.distcp" if form == "folder" else paths[-1]
    stat = damaged.stat()
    if form == "folder":
        data = bytearray(damaged.read_bytes())
        data[len(data) // 2] ^= 0xFF
        damaged.write_bytes(bytes(data))
    else:
        flip_byte_in_tensor_record(damaged)
    assert damaged.stat().st_size == stat.st_size
    if restarted:
        os.utime(damaged, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        checked._known.clear()  # what a new process remembers: nothing
    with caplog.at_level(logging.WARNING, logger="dist_resume"), dr.CheckpointManager(tmp_path, keep_last=2) as mgr:
        mgr.save(40, model=filled(40))
        names = [p.name for p in mgr.checkpoints()]
    assert names == [paths[1].name, paths[2].name, "ckpt_00000040.pt"], names
    warned = [r.getMessage() for r in caplog.records if "damaged checkpoint" in r.getMessage()]
    assert len(warned) == 1 and paths[2].name in warned[0] and "CRC" in warned[0], warned
    assert dr.tools.latest_checkpoint(tmp_path) == tmp_path / "ckpt_00000040.pt"
    (tmp_path / "ckpt_00000040.pt").unlink()  # the newest gone: the fallback is the valid 20, never the damaged 30
    assert dr.tools.latest_checkpoint(tmp_path) == paths[1]


def test_the_new_checkpoint_is_read_back_once_in_the_background_for_save_async(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[str, bool, str]] = []
    real = listing.inspect_checkpoint  # type: ignore[attr-defined]  # the name listing imported (patched there)

    def recording(p: Path, verify: bool = True) -> Any:
        seen.append((p.name, verify, threading.current_thread().name))
        return real(p, verify=verify)

    monkeypatch.setattr(listing, "inspect_checkpoint", recording)
    with dr.CheckpointManager(tmp_path, keep_last=2) as mgr:
        mgr.save_async(1, model=filled(1)).wait()
        mgr.save_async(2, model=filled(2)).wait()
        mgr.save_async(3, model=filled(3)).wait()
    assert [(name, verify) for name, verify, _ in seen] == [(f"ckpt_0000000{s}.pt", True) for s in (1, 2, 3)]
    assert all(thread.startswith("dist_resume-save-") for _, _, thread in seen), seen  # never the training thread


def _write(folder: Path, steps: int) -> None:
    """Training's side: a save per step with keep_last=2, a file (saved and rotated by the manager) or, every third
    step, a sharded folder (committed by one rename, as an FSDP2 save commits one) rotated as the manager rotates."""
    model = nn.Linear(4, 4)
    with dr.CheckpointManager(folder, keep_last=2) as mgr:
        for step in range(1, steps + 1):
            with torch.no_grad():
                model.weight.fill_(step)
            if step % 3:
                mgr.save(step, model=model)
            else:
                made = dr.save_checkpoint(folder.parent / "staging.pt", model=model, step=step)
                dst = dr.tools.convert_checkpoint(
                    made, folder / f"ckpt_{step:08d}.dcp", format="sharded", force=True
                ).dst
                rotate_out(folder, dst, step, 2)


def test_readers_racing_a_writer_never_see_a_raw_error_nor_call_it_damaged(tmp_path: Path) -> None:
    """An eval job's loop (latest, list on both paths, resume) while training saves 30 checkpoints with keep_last=2,
    files and sharded folders, each save rotating one out: every answer is a checkpoint that exists, sound."""
    folder = tmp_path / "ckpts"
    failed: list[BaseException] = []

    def write() -> None:
        try:
            _write(folder, 30)
        except BaseException as err:
            failed.append(err)

    writer = threading.Thread(target=write, name="training")  # a thread: the reader races it at every file operation
    writer.start()
    wrong: list[str] = []
    rounds = 0
    try:
        while dr.tools.latest_checkpoint(folder) is None and writer.is_alive():
            time.sleep(0.01)
        while writer.is_alive():
            rounds += 1
            for name, read in (
                ("latest_checkpoint", lambda: dr.tools.latest_checkpoint(folder)),
                ("list", lambda: list_folder(folder)),
                ("list (torch path)", lambda: list_folder(folder, fast=False)),
                ("resume", lambda: dr.resume(folder, model=nn.Linear(4, 4), options=dr.ResumeOptions(rng=False))),
            ):
                try:
                    got: Any = read()
                except Exception as err:
                    wrong.append(f"round {rounds}, {name}: {type(err).__name__}: {str(err)[:200]}")
                    continue
                if got is None or (
                    isinstance(got, dict)
                    and (got["pick"] is None or any(e["status"] != "valid" for e in got["checkpoints"]))
                ):
                    wrong.append(f"round {rounds}, {name}: {got}")
    finally:
        writer.join(timeout=120)
    assert not writer.is_alive() and failed == [], failed
    assert rounds >= 3, f"only {rounds} rounds while the writer ran"
    assert wrong == [], "\n".join(wrong[:20])


# ------------------------------------------------------------------ a reader whose chosen checkpoint is removed


_READERS: dict[str, Callable[[Any], object]] = {
    "load_checkpoint": lambda p: dr.load_checkpoint(p, map_location="cpu"),
    "load_checkpoint(verify=True)": lambda p: dr.load_checkpoint(p, map_location="cpu", verify=True),
    "inspect_checkpoint": lambda p: dr.tools.inspect_checkpoint(p),
    "verify_archive": lambda p: dr.tools.verify_archive(p),
    "resume": lambda p: dr.resume(p, model=nn.Linear(4, 4), options=dr.ResumeOptions(rng=False)),
}
# (module, name): each step of a read that opens or looks at the file again, after the path was checked
_STEPS = [
    (sniff, "open_checkpoint_file"),  # its first bytes (what kind of file)
    (records, "_read_directory"),  # the zip directory
    (small_records, "open_binary"),  # the small records' CRC-32s
    (zip_verify, "_bytes_of"),  # every record's CRC-32
    (torch, "load"),  # torch.load itself (as load_torch_file calls it)
]


@pytest.mark.parametrize("reader", list(_READERS))
@pytest.mark.parametrize("step", _STEPS, ids=[name for _, name in _STEPS])
def test_a_checkpoint_removed_during_a_read_is_not_found_at_every_step_of_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reader: str, step: tuple[Any, str]
) -> None:
    """The failure injected at each step (the file unlinked just before it): ``CheckpointNotFoundError`` (a
    ``FileNotFoundError`` too) saying it was removed, never a raw ``FileNotFoundError`` nor "damaged"."""
    path = dr.save_checkpoint(tmp_path / "ckpt_00000001.pt", model=nn.Linear(4, 4), step=1)
    module, name = step
    real = getattr(module, name)
    hit: list[bool] = []

    def removed_first(*args: Any, **kwargs: Any) -> Any:
        if not hit:
            hit.append(True)
            os.unlink(path)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, removed_first)
    try:
        _READERS[reader](path)
    except CheckpointNotFoundError as err:
        assert "removed" in str(err) and str(path) in str(err), str(err)
    else:
        assert not hit, f"{reader} read {path.name} after it was removed"  # a reader that never takes this step


def _race(folder: Path, rounds_wanted: int, cap_seconds: float) -> None:
    """A writer saving every few ms with keep_last=2 (a thread: the reader races it at every file operation) and a
    reader that chooses with ``latest_checkpoint`` and then reads the choice by path, for ``rounds_wanted`` rounds (a
    count, not a time: a loaded machine or a coverage run is slower, not less raced); ``cap_seconds`` bounds it."""
    stop = threading.Event()
    failed: list[BaseException] = []

    def write() -> None:
        model = nn.Linear(4, 4)
        try:
            with dr.CheckpointManager(folder, keep_last=2) as mgr:
                step = 0
                while not stop.is_set():
                    step += 1
                    mgr.save(step, model=model)  # a few ms each
        except BaseException as err:
            failed.append(err)

    writer = threading.Thread(target=write, name="training")
    writer.start()
    outcomes: dict[str, int] = {}
    raw: list[str] = []
    rounds = 0
    try:
        while dr.tools.latest_checkpoint(folder) is None and writer.is_alive():
            time.sleep(0.01)
        deadline = time.monotonic() + cap_seconds
        while rounds < rounds_wanted and time.monotonic() < deadline and writer.is_alive():
            for name, read in _READERS.items():
                if name == "resume" and rounds % 10:
                    continue  # the slowest reader, one round in ten
                rounds += 1
                chosen = dr.tools.latest_checkpoint(folder)
                assert chosen is not None, "a folder being saved into had no checkpoint"
                try:
                    read(chosen)
                    what = "read"
                except DistResumeError as err:
                    what = type(err).__name__
                except Exception as err:  # the point of the test: none may come out
                    what = f"raw {type(err).__name__}"
                    raw.append(f"round {rounds}, {name}: {type(err).__name__}: {str(err)[:200]}")
                outcomes[what] = outcomes.get(what, 0) + 1
    finally:
        stop.set()
        writer.join(timeout=60)
    assert not writer.is_alive() and failed == [], failed
    assert raw == [], "\n".join(raw[:20])
    assert set(outcomes) <= {"read", "CheckpointNotFoundError"}, outcomes  # a removed checkpoint is never "damaged"
    assert rounds >= rounds_wanted and outcomes.get("read", 0) > rounds // 2, (rounds, outcomes)


def test_readers_choosing_then_reading_while_a_writer_rotates_get_only_typed_outcomes(tmp_path: Path) -> None:
    _race(tmp_path / "ckpts", rounds_wanted=1000, cap_seconds=120)


@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_long_readers_choosing_then_reading_while_a_writer_rotates(tmp_path: Path) -> None:  # about 2 min
    _race(tmp_path / "ckpts", rounds_wanted=12_000, cap_seconds=900)
