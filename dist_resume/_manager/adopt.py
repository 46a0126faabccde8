"""Another run's checkpoint written into a checkpoint folder as the folder's checkpoint of its step.

``dist-resume convert FILE --into FOLDER`` and :func:`~dist_resume.tools.convert_into_folder`: any file or folder
``resume`` reads (nanoGPT's ``ckpt.pt``, a Lightning ``.ckpt``, an HF Trainer ``checkpoint-N/``, this toolkit's own
files) becomes ``FOLDER/ckpt_<step>.pt`` in the format a :class:`CheckpointManager` save writes, so that
``CheckpointManager(FOLDER, ...).resume()`` continues that run at its step. It lives beside the manager (not in
``_convert``) because it writes into a manager's folder under the manager's lock.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._core.errors import CheckpointError, UsageError
from .._core.location import Location
from .._core.text import preview
from .._core.tree import plain_namespaces
from .._core.types import PathLike
from .._format.atomic import atomic_write, remove_path
from .._layout.layout import FORMAT_NAME, FORMAT_VERSION, CheckpointParts, Key, Layout, split_checkpoint
from .._source.listing import check_numbered, checkpoint_name, numbered_checkpoints
from .._source.read import read_source
from .._source.source import local_source
from .._state.prefix import canonical_key, prefix_style, strip_prefix
from .._store.url import location
from .lease import writer_lock
from .lock import remove_new_folder
from .resume_point import resume_point
from .start import folder_state

__all__ = ["FolderConvertResult", "convert_into_folder"]


@dataclass(frozen=True)
class FolderConvertResult:
    """What :func:`convert_into_folder` wrote: ``path`` (``FOLDER/ckpt_<step>.pt``), the ``step`` and where it came
    from (``step_from``: ``"--step"``, the source's key such as ``'iter_num'``, ``trainer_state.json``, the epochs
    times ``--steps-per-epoch``, ...), the ``epoch`` the next run continues in and where it came from
    (``epoch_from``; None without an epoch), the source's ``layout``, its model keys' prefix before (the file holds
    them without one), whether a checkpoint of that step was replaced (``force``)."""

    src: Location
    path: Location
    step: int
    step_from: str
    epoch: int | None
    epoch_from: str | None
    layout: Layout
    prefix_before: str
    model_keys: int
    replaced: bool
    bytes_written: int
    seconds: float


def convert_into_folder(
    src: PathLike,
    folder: PathLike,
    *,
    step: int | None = None,
    steps_per_epoch: int | None = None,
    force: bool = False,
    part_keys: Mapping[str, str] | None = None,
    check_crc: bool = False,
) -> FolderConvertResult:
    """Write ``src`` into the checkpoint folder ``folder`` as its checkpoint of ``step``: ``ckpt_<step>.pt``, the
    format :meth:`CheckpointManager.save` writes (model keys without ``module.``/``_orig_mod.``, ``meta.step``),
    atomically, so that ``CheckpointManager(folder, ...).resume()`` continues at that step. Local.

    ``src`` is anything ``resume`` reads: a torch file in any layout (nanoGPT's ``ckpt.pt``, a Lightning ``.ckpt``,
    this toolkit's files), an HF Trainer, Accelerate, DCP or sharded checkpoint folder, a ``.safetensors`` file.
    The step and the epoch are where the source's own resume would continue: ``step``
    defaults to the source's own (``meta.step``, Lightning's and HF's ``global_step``, a top-level
    ``iter_num``/``step``/``global_step``/..., an Accelerate folder named ``step_N``); the epoch is the one the next
    run continues in (``meta.epoch``, torchvision's and timm's finished ``epoch`` + 1, Lightning's fit loop, HF's
    whole epochs, an Accelerate folder named ``epoch_N``: N + 1). A source with an epoch but no step continues at
    step ``epoch x steps_per_epoch`` (0 without it); one with neither raises :class:`UsageError` saying to pass
    ``step``. Every other part (optimizer, scheduler, scaler, EMA, RNG streams and data position of this toolkit's
    files, the rest of the dict under ``extra``, an ``argparse.Namespace`` there as a plain dict) is kept.

    The folder takes the manager's write lock while it is written (a live job saving into it is named and refused)
    and is created when missing (removed again if the conversion fails). A folder holding a checkpoint of a later
    step is refused: ``resume`` would pick that one. A checkpoint of the same step is refused unless ``force``,
    which replaces it. ``part_keys`` (``{"model": "MODEL_STATE"}``) names a torch file's entries where detection
    should not decide; ``check_crc`` checks every CRC-32 of the source first.

    Example::

        >>> torch.save({"model": torch.nn.Linear(2, 2).state_dict(), "iter_num": 300}, "ckpt.pt")
        >>> convert_into_folder("ckpt.pt", "run").path.name
        'ckpt_00000300.pt'
        >>> CheckpointManager("run", model=torch.nn.Linear(2, 2)).resume().step
        300
    """
    start = time.perf_counter()
    src_at, folder_at = location(src), location(folder)
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise UsageError(f"step must be a non-negative int (it names the file), got {step!r}", "e.g. --step 300")
    if steps_per_epoch is not None and (
        isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, int) or steps_per_epoch < 1
    ):
        raise UsageError(
            f"steps_per_epoch must be a positive int (optimizer steps in one epoch), got {steps_per_epoch!r}",
            "e.g. --steps-per-epoch 5005",
        )
    parts = _read_parts(src_at, part_keys, check_crc)
    point = resume_point(parts, src_at, step=step, steps_per_epoch=steps_per_epoch)
    chosen = point.step
    payload = _payload(parts, chosen, point.epoch)
    folder_state(folder_at)  # a file, a checkpoint itself, a missing parent: refused before anything is written
    lock = writer_lock(folder_at)
    created = isinstance(folder_at, Path) and not folder_at.exists()
    lock.acquire()
    try:
        dest = folder_at / checkpoint_name(chosen)
        replaced = _check_room(folder_at, src_at, dest, chosen, force)
        atomic_write(dest, lambda f: torch.save(payload, f))
        _read_back(dest, chosen)
    except BaseException:
        if created and isinstance(folder_at, Path):
            remove_new_folder(folder_at)
        raise
    finally:
        lock.release()
    return FolderConvertResult(
        src=src_at,
        path=dest,
        step=chosen,
        step_from=point.step_from,
        epoch=point.epoch,
        epoch_from=point.epoch_from,
        layout=parts.layout,
        prefix_before=prefix_style(parts.model.keys()),
        model_keys=len(payload[Key.MODEL]),
        replaced=replaced,
        bytes_written=dest.stat().st_size,
        seconds=time.perf_counter() - start,
    )


def _read_parts(src: Location, part_keys: Mapping[str, str] | None, check_crc: bool) -> CheckpointParts:
    """``src`` as :class:`CheckpointParts`, read as ``resume`` reads it (memory-mapped on the CPU)."""
    source = local_source(src)
    if part_keys and source.layout is not None:
        raise UsageError(
            f"--part names entries of a torch file, and {str(src)!r} is {source.layout.value!r}",
            "leave --part out: a foreign checkpoint's parts are read from its files",
        )
    contents = read_source(source, map_location="cpu", mmap=True, verify=check_crc)
    if contents.parts is not None:
        return contents.parts
    return split_checkpoint(contents.obj, source=repr(str(src)), part_keys=part_keys)


def _payload(parts: CheckpointParts, step: int, epoch: int | None) -> dict[str, Any]:
    """``parts`` as the dict a manager's save writes: the model under canonical keys, the optimizer's
    ``param_names`` canonical, ``meta.step`` and ``meta.epoch`` where the next run continues, ``extra``'s
    Namespaces as plain dicts (it then loads under plain ``weights_only=True``); every other part as it is."""
    style = prefix_style(parts.model.keys())
    model = strip_prefix(parts.model, style) if style not in ("none", "mixed") else dict(parts.model)
    meta = dict(parts.meta)
    if parts.layout is not Layout.TOOLKIT:
        meta.setdefault("source_layout", parts.layout.value)
    meta.update(step=step, epoch=epoch)
    obj: dict[str, Any] = {Key.FORMAT: FORMAT_NAME, Key.VERSION: FORMAT_VERSION, Key.MODEL: model, Key.META: meta}
    for key, value in (
        (Key.OPTIMIZER, _canonical_names(parts.optimizer)),
        (Key.SCHEDULER, parts.scheduler),
        (Key.SCALER, parts.scaler),
        (Key.EXTRA, plain_namespaces(parts.extra)),
        (Key.RNG, parts.rng),
        (Key.SAMPLER, parts.sampler),
        (Key.EMA, parts.ema),
    ):
        if value is not None:
            obj[key] = value
    return obj


def _canonical_names(optimizer: Any) -> Any:
    """The optimizer state dict with each group's ``param_names`` in canonical form (a new dict; state shared)."""
    if not isinstance(optimizer, Mapping) or not isinstance(optimizer.get("param_groups"), list):
        return optimizer
    groups = [
        {**g, "param_names": [canonical_key(n) if isinstance(n, str) else n for n in g["param_names"]]}
        if isinstance(g, Mapping) and isinstance(g.get("param_names"), list)
        else g
        for g in optimizer["param_groups"]
    ]
    return {**optimizer, "param_groups": groups}


def _check_room(folder: Location, src: Location, dest: Location, step: int, force: bool) -> bool:
    """Refuse a folder where the new checkpoint would not be the one ``resume`` picks; whether one is replaced."""
    numbered = numbered_checkpoints(folder)
    later = [p for s, p in numbered if s > step]
    if later:
        raise UsageError(
            f"checkpoint folder {str(folder)!r} holds checkpoint(s) after step {step}: "
            f"{preview((str(p) for p in later), 4)}; resume picks the newest, so a checkpoint of step {step} "
            "would never be read",
            "convert into a new folder, or move the later checkpoints out of this one first",
        )
    same = [p for s, p in numbered if s == step]
    if str(src) in {str(p) for p in same}:
        raise UsageError(f"{str(src)!r} is already the checkpoint of step {step} in {str(folder)!r}", "nothing to do")
    if any(p != dest for p in same):  # ckpt_<step>.dcp/: a sharded folder is never replaced by a file
        raise UsageError(
            f"checkpoint folder {str(folder)!r} holds a sharded checkpoint of step {step}: "
            f"{preview((str(p) for p in same), 4)}",
            "convert into a new folder, or remove that checkpoint yourself first",
        )
    if same and not force:
        raise UsageError(
            f"checkpoint folder {str(folder)!r} holds a checkpoint of step {step} already: {str(dest)!r}",
            "pass --force (force=True) to replace it",
        )
    return bool(same)


def _read_back(dest: Location, step: int) -> None:
    """Check the file just written as ``resume`` will (every CRC-32); remove it if it does not read back."""
    try:
        check_numbered(dest, step, verify=True)
    except (CheckpointError, OSError):
        remove_path(dest)
        raise
