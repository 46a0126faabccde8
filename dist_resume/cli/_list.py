"""``dist-resume list``: a checkpoint folder's checkpoints, valid or damaged, its leftover temporary files,
and the one ``resume`` would pick; for an HF Trainer output folder, its ``checkpoint-N/`` folders."""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

from .._core.errors import CheckpointError, CheckpointNotFoundError, DistResumeError, UsageError
from .._core.location import Location, RemotePath
from .._core.text import preview
from .._format.atomic import TEMP_NAME
from .._format.manifest import TRAIN_STATE
from .._manager.lease import LEASE_NAME
from .._manager.lock import LOCK_NAME
from .._shm.identity import IDENTITY_NAME
from ._common import SCHEMA_PREFIX, human_bytes
from ._fast import CHECKPOINT_NAME, fast_entries, shards_of

__all__ = ["list_folder", "render_list"]

SCHEMA = f"{SCHEMA_PREFIX}/list/1"
_HF_STEP_DIR: Final = re.compile(r"^checkpoint-(\d+)$")


def _age(path: Location, now: float) -> tuple[int, float]:
    """Size and age of ``path``; of the link itself where it cannot be followed (a loop: damage, said below)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise
    except OSError:
        if not isinstance(path, Path):
            raise
        st = path.lstat()
    return st.st_size, max(0.0, now - st.st_mtime)


def _checkpoint(path: Location, verify: bool, now: float) -> dict[str, Any] | None:
    """One ``ckpt_<step>.pt``: its size, age and metadata, ``valid`` or ``damaged`` with the reason; None when it is
    gone by the time it is read (a writer's rotation deleted it after the listing: not damage). The verdict is the
    manager's own (:func:`~dist_resume._source.listing.check_numbered`), so a row is valid exactly when a resume of
    the folder would take it."""
    from .._format.archive import read_archive
    from .._layout.layout import Key
    from .._source.listing import check_numbered, exists

    match = CHECKPOINT_NAME.match(path.name)
    step = int(match.group(1)) if match else None
    try:
        size, age = _age(path, now)
    except FileNotFoundError:
        return None
    entry: dict[str, Any] = {"name": path.name, "step": step, "epoch": None, "world_size": None}
    entry |= {"bytes": size, "age_seconds": round(age, 1), "status": "valid", "reason": None, "shards": None}
    try:
        if step is None:  # (never: the listing matched the name)
            raise CheckpointError(f"{path.name} is not named ckpt_<step>")
        info = check_numbered(path, step, verify)
        meta = read_archive(path / TRAIN_STATE if path.is_dir() else path).obj[Key.META]  # a sharded folder's
        entry["epoch"], entry["world_size"], entry["bytes"] = meta.get("epoch"), meta.get("world_size"), info.size
        entry["shards"] = shards_of(path) if path.is_dir() else None
    except (CheckpointError, OSError) as err:
        if not exists(path):
            return None
        reason = str(err).replace(f"{str(path)!r}", path.name).replace(str(path), path.name)
        entry |= {"status": "damaged", "reason": f"{type(err).__name__}: {reason}"}
    return entry


def _temps(folder: Location, now: float) -> list[dict[str, Any]]:
    """What interrupted saves left: temporary files (``.ckpt_<step>.pt.<16 hex>.tmp``) on local disk; on a store,
    where a killed upload leaves nothing visible, the sharded folders without their manifest (what the next save
    removes there). The lock file and the lease object are never listed."""
    if isinstance(folder, RemotePath):
        from .._source.listing import uncommitted

        leftovers = uncommitted(folder)
    else:
        leftovers = [path for path in folder.iterdir() if TEMP_NAME.match(path.name) and path.is_file()]
    found = []
    for path in sorted(leftovers):
        try:
            size, age = _age(path, now)
        except FileNotFoundError:  # a save in progress renamed (or committed) it meanwhile
            continue
        found.append({"name": path.name, "bytes": size, "age_seconds": round(age, 1)})
    return found


def _hf_output(folder: Location, now: float) -> list[dict[str, Any]]:
    """An HF Trainer ``output_dir``: each ``checkpoint-N/`` with its step (trainer_state.json's global_step). Local
    folders only: dist_resume reads its own checkpoints from an object store, not HF's."""
    from .._foreign.folders import detect_folder, trainer_progress

    if isinstance(folder, RemotePath):
        return []
    found = []
    for sub in folder.iterdir():
        match = _HF_STEP_DIR.match(sub.name)
        if not match or not sub.is_dir():
            continue
        step, epoch, reason = int(match.group(1)), None, None
        try:  # global_step and the epoch as HF counts it (a regular trainer_state.json only: never a FIFO)
            progress, _, epoch = trainer_progress(sub)
            step = step if progress is None else progress
        except CheckpointError as err:
            reason = f"trainer_state.json unreadable: {type(err).__name__}"
        kind = detect_folder(sub)
        size = sum(p.stat().st_size for p in sub.iterdir() if p.is_file())
        entry: dict[str, Any] = {"name": sub.name + "/", "step": step, "epoch": epoch, "world_size": None}
        entry |= {"bytes": size, "age_seconds": round(max(0.0, now - sub.stat().st_mtime), 1)}
        entry |= {"status": "valid" if kind is not None else "damaged"}
        entry["reason"] = reason if kind is not None else "no model, optimizer or trainer_state.json files"
        found.append(entry)
    return sorted(found, key=lambda e: (e["step"], e["name"]))


def _crc_check_newest(folder: Location, checkpoints: list[dict[str, Any]]) -> None:
    """Mark damaged the newest checkpoints that ``resume`` (which checks every CRC) would skip."""
    from .._source.listing import find_latest

    with _rows_say_it():
        _, skipped = find_latest(folder, verify=True)
    reasons = {path.name: err for path, err in skipped}
    for entry in checkpoints:
        if entry["status"] == "valid" and (err := reasons.get(entry["name"])) is not None:
            reason = str(err).replace(str(folder / entry["name"]), entry["name"])
            entry |= {"status": "damaged", "reason": f"{type(err).__name__}: {reason}"}


class _Skipped(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("skipping checkpoint ")


@contextlib.contextmanager
def _rows_say_it() -> Iterator[None]:
    """Drop the library's "skipping checkpoint" warning while the report is built: the checkpoint's DAMAGED row
    says it, one statement per fact."""
    quiet = _Skipped()
    logger = logging.getLogger("dist_resume")  # by name: _core.log imports torch, and list may run without it
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def list_folder(path: Location, *, verify: bool = False, fast: bool = True) -> dict[str, Any]:
    """The report of ``dist-resume list``. Local; reads each checkpoint's zip directory and pickle (and with
    ``verify`` every record's CRC-32), never loads tensor data.

    ``fast`` (default) answers without importing torch when every entry is a sound checkpoint of this toolkit
    (:mod:`._fast`); any other folder, or any doubt, is listed by the torch path, so the report is the same.
    """
    folder = path
    if not folder.exists():
        raise CheckpointNotFoundError(f"folder {str(folder)!r} does not exist")
    if not folder.is_dir():
        raise UsageError(f"{str(folder)!r} is a file, not a folder", f"run `dist-resume inspect {folder}` on a file")
    now = time.time()
    if fast:
        try:
            checkpoints = fast_entries(folder, verify, now)
            return _report(folder, verify, now, checkpoints, "checkpoint-manager")
        except Exception:  # PeekUnsure, or anything the fast path did not foresee: the torch path decides
            pass
    return _torch_list(folder, verify, now)


def _others(folder: Location) -> list[str]:
    return sorted(
        p.name
        for p in folder.iterdir()
        if p.name not in (LOCK_NAME, LEASE_NAME, IDENTITY_NAME)
        and not TEMP_NAME.match(p.name)
        and not CHECKPOINT_NAME.match(p.name)
        and not _HF_STEP_DIR.match(p.name)
    )


def _torch_list(folder: Location, verify: bool, now: float) -> dict[str, Any]:
    from .._foreign.folders import detect_folder
    from .._source.listing import RELISTS, numbered_checkpoints

    for _ in range(RELISTS):  # a checkpoint gone meanwhile (a writer rotated it out): the folder listed again
        rows = [_checkpoint(p, verify, now) for _, p in numbered_checkpoints(folder)]
        if None not in rows:
            break
    checkpoints = [row for row in rows if row is not None]
    others = _others(folder)
    kind = "checkpoint-manager" if checkpoints else "empty" if not others else "no checkpoints"
    if not checkpoints and (hf := _hf_output(folder, now)):
        kind, checkpoints = "hf-trainer-output", hf
    elif not checkpoints and (foreign := detect_folder(folder)) is not None:
        kind = foreign.value  # one foreign checkpoint: `dist-resume inspect` and resume() read it as a whole
    if kind == "checkpoint-manager" and not verify:
        _crc_check_newest(folder, checkpoints)  # resume checks CRCs newest first: say what it will skip
    return _report(folder, verify, now, checkpoints, kind)


def _report(folder: Location, verify: bool, now: float, checkpoints: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    others = _others(folder)
    valid = [e for e in checkpoints if e["status"] == "valid"]
    pick = valid[-1]["name"] if valid else None
    if pick is not None:
        why = None
    elif checkpoints:
        why = "every checkpoint is damaged: resume raises CheckpointCorruptError"
    elif subs := _subfolders(folder):
        why = f"it holds checkpoint folders one level down ({preview((s.name + '/' for s in subs), 4)}): pass one to resume()"
    elif kind in ("empty", "no checkpoints"):
        why = "no checkpoint: CheckpointManager.resume starts fresh (or from init_from)"
        if others:
            why += "; the other files are not checkpoints of a CheckpointManager (pass a file to resume(path))"
    else:
        why = f"the folder itself is {kind} checkpoint: pass it to resume()"
    return {
        "schema": SCHEMA,
        "folder": str(folder),
        "kind": kind,
        "verified": verify,
        "checkpoints": checkpoints,
        "temporary_files": _temps(folder, now),
        "other_files": others,
        "pick": pick,
        "pick_note": why,
        "memory_snapshots": _memory_rows(folder, now),
    }


def _memory_rows(folder: Location, now: float) -> list[dict[str, Any]]:
    """This node's complete snapshots of ``folder`` in shared memory (:meth:`CheckpointManager.snapshot`)."""
    from .._shm import snapshots

    try:
        found = snapshots(folder)
    except DistResumeError:
        return []
    return [
        {
            "step": s.step,
            "file": str(s.path),
            "bytes": s.size,
            "age_seconds": max(0.0, now - s.created),
            "in_folder": s.persisted,
        }
        for s in found
    ]


def _subfolders(folder: Location) -> list[Location]:
    from .._foreign.folders import checkpoint_subfolders

    return checkpoint_subfolders(folder)


def _shards_text(shards: dict[str, Any]) -> str:
    mesh = "no mesh" if shards["mesh_shape"] is None else "mesh " + " x ".join(map(str, shards["mesh_shape"]))
    return f"sharded: {shards['shard_files']} shard file(s) by {shards['writers']} rank(s), {mesh}"


def _age_text(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit} ago"
    return f"{int(seconds)}s ago"


def render_list(report: dict[str, Any]) -> str:
    """The report as the table ``dist-resume list`` prints."""
    rows = report["checkpoints"]
    temps = report["temporary_files"]
    checked = "CRC-32 checked" if report["verified"] else "structure checked; --verify checks every CRC-32"
    lines = [f"{report['folder']}: {report['kind']}, {len(rows)} checkpoint(s), {len(temps)} temporary file(s)"]
    if rows:
        table: list[tuple[str, ...]] = [("file", "step", "epoch", "size", "age", "world", "status")]
        for e in rows:
            status = "valid" if e["status"] == "valid" else f"DAMAGED: {e['reason']}"
            if e.get("shards") and e["status"] == "valid":
                status += f" ({_shards_text(e['shards'])})"
            cells = (e["name"], e["step"], e["epoch"], human_bytes(e["bytes"]), _age_text(e["age_seconds"]))
            table.append((*(str("-" if c is None else c) for c in cells), str(e["world_size"] or "-"), status))
        widths = [max(len(r[i]) for r in table) for i in range(6)]
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[6] for r in table]
        lines.append(f"  ({checked})")
    if temps:
        lines.append("temporary files left by interrupted saves (the next save into this folder removes them):")
        lines += [f"  {t['name']}  {human_bytes(t['bytes'])}  {_age_text(t['age_seconds'])}" for t in temps]
    if report["other_files"]:
        lines.append(f"other files (not listed as checkpoints): {preview(report['other_files'], 8)}")
    if snaps := report.get("memory_snapshots"):
        lines.append(
            "snapshots in this node's shared memory (resume takes the newest when the folder has nothing newer):"
        )
        lines += [
            f"  step {m['step']}  {human_bytes(m['bytes'])}  {_age_text(m['age_seconds'])}"
            f"  {'in the folder too' if m['in_folder'] else 'not in the folder yet'}  {m['file']}"
            for m in snaps
        ]
    if report["pick"] is not None:
        picked = next(e for e in rows if e["name"] == report["pick"])
        if report["kind"] == "hf-trainer-output":  # resume() takes one checkpoint-N/ folder, not the output folder
            where = f"{str(report['folder']).rstrip('/')}/{str(report['pick']).strip('/')}"
            lines.append(f"newest complete: {report['pick']} (step {picked['step']}): resume from {where}")
        else:
            lines.append(f"resume would pick: {report['pick']} (step {picked['step']})")
    else:
        lines.append(f"resume would pick: nothing ({report['pick_note']})")
    return "\n".join(lines)
