"""How a resume reads and restores: one frozen value, :class:`ResumeOptions`, validated once when it is built."""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from .._core.errors import UsageError
from .._core.types import MapLocation
from .._layout.detect import check_part_keys
from .._state.subtree import check_key_prefix

__all__ = ["OPTIONAL_PARTS", "OptimizerHparams", "ResumeOptions", "allowed_missing"]

# the parts a file may lack when allow_missing names them; the RNG streams need no permission (see ResumeOptions.rng)
OPTIONAL_PARTS: Final = ("optimizer", "scheduler", "scaler", "sampler", "ema")


class OptimizerHparams(enum.Enum):
    """Whose param-group hyperparameters (``lr``, ``betas``, ``weight_decay``, ...) a resumed optimizer keeps."""

    CHECKPOINT = "checkpoint"  # torch's rule: Optimizer.load_state_dict replaces them with the file's
    CURRENT = "current"  # keep the live optimizer's; restore only the per-parameter state

    @classmethod
    def parse(cls, value: OptimizerHparams | str) -> OptimizerHparams:
        """``value`` as a member; a string outside the two values raises :class:`UsageError`."""
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            raise UsageError(
                f"optimizer_hparams={value!r} is not one of 'checkpoint', 'current'",
                hint="'checkpoint' takes lr, betas, ... from the file (torch's rule), 'current' keeps this optimizer's",
            ) from None


def allowed_missing(names: str | Iterable[str] | None) -> frozenset[str]:
    """The set of part names ``allow_missing=`` names (``"all"``: every optional part). Raises
    :class:`UsageError` naming the valid names for anything else. A single string is one name."""
    if names is None:
        return frozenset()
    given = [names] if isinstance(names, str) else list(names)
    if "rng" in given:
        raise UsageError(
            "allow_missing names 'rng', which needs no permission: with rng=True a file without RNG state "
            "leaves the streams as they are and lists 'rng' in ResumeResult.skipped",
            hint="remove 'rng' from allow_missing; pass rng=False not to restore the RNG streams at all",
        )
    unknown = [n for n in given if n != "all" and n not in OPTIONAL_PARTS]
    if unknown or not all(isinstance(n, str) for n in given):
        raise UsageError(
            f"allow_missing names unknown parts {unknown!r}; valid names: "
            + ", ".join(repr(n) for n in (*OPTIONAL_PARTS, "all")),
            hint="e.g. allow_missing=('scheduler',) lets a file without scheduler state resume",
        )
    return frozenset(OPTIONAL_PARTS) if "all" in given else frozenset(given)


_FLAGS: Final = ("strict", "rng", "mmap", "weights_only", "verify", "broadcast_from_rank0")


@dataclass(frozen=True, kw_only=True, slots=True)
class ResumeOptions:
    """How :func:`resume` (and :meth:`CheckpointManager.resume`) reads a checkpoint and restores it.

    Local; a frozen value, validated once when built (a typo fails where the options are written, before any
    file is read), so one instance can be kept and passed to every resume of a run. Every field is keyword-only:

    - ``strict`` (True) keeps torch's meaning for the model: missing/unexpected keys raise, dtypes must match.
      ``strict=False`` loads the keys that fit and casts floating-point tensors; if *no* key fits it still raises
      :class:`~dist_resume.errors.KeyMismatchError`. For compatibility ``strict=False`` also skips parts the file
      lacks, with a WARNING; ``allow_missing`` is the precise way.
    - ``allow_missing`` (none): the parts that may be absent from the file, any of ``"optimizer"``,
      ``"scheduler"``, ``"scaler"``, ``"sampler"``, ``"ema"``, or ``"all"``; a string is one name. Kept as a
      frozenset. Each absent allowed part is left as it is and listed in ``ResumeResult.skipped``; a part
      passed but absent and not allowed raises :class:`~dist_resume.errors.StateMismatchError`.
    - ``optimizer_hparams`` (``"checkpoint"``, torch's rule) takes each group's ``lr``, ``betas``,
      ``weight_decay``, ... from the file; ``"current"`` restores the per-parameter state but keeps the live
      optimizer's group hyperparameters (``initial_lr`` too). A string is kept as its :class:`OptimizerHparams`.
    - ``rng`` (True, as on save): each rank restores its own saved RNG streams (python, torch CPU, its device,
      numpy) when the file holds them; a file without RNG state (every foreign file) leaves the streams as
      they are, lists ``"rng"`` in ``ResumeResult.skipped`` and says so once at INFO. ``False`` never
      touches them.
    - ``key_prefix`` (None): load only the model keys under this prefix, without it (``"model."`` for a
      Lightning checkpoint of ``self.model``).
    - ``part_keys`` (None): ``{"model": "MODEL_STATE", ...}`` names the entry each part of a torch file
      comes from, overriding layout detection (``"state.net"`` one level down).
    - ``map_location`` (None: the CPU, the file memory-mapped and copied into the existing tensors),
      ``mmap`` (True), ``weights_only`` (True): how the file is read, as ``torch.load`` takes them.
    - ``verify`` (False): check the CRC-32 of every record before loading.
    - ``broadcast_from_rank0`` (False): collective; only global rank 0 opens the file and the state
      reaches the other ranks through torch.distributed broadcasts (for node-local disks). It takes no
      ``map_location``: the state arrives on the CPU and is copied into the live tensors.

    Example::

        >>> opts = dist_resume.ResumeOptions(allow_missing="scheduler", optimizer_hparams="current")
        >>> sorted(opts.allow_missing), opts.optimizer_hparams
        (['scheduler'], <OptimizerHparams.CURRENT: 'current'>)
        >>> dist_resume.ResumeOptions(allow_missing="schedular")
        Traceback (most recent call last):
        dist_resume.errors.UsageError: allow_missing names unknown parts ['schedular']; valid names: ...
    """

    strict: bool = True
    allow_missing: str | Collection[str] = frozenset()
    optimizer_hparams: OptimizerHparams | str = OptimizerHparams.CHECKPOINT
    rng: bool = True
    key_prefix: str | None = None
    part_keys: Mapping[str, str] | None = None
    map_location: MapLocation = None
    mmap: bool = True
    weights_only: bool = True
    verify: bool = False
    broadcast_from_rank0: bool = False

    def __post_init__(self) -> None:
        for name in _FLAGS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise UsageError(f"ResumeOptions({name}={value!r}): {name} must be True or False")
        object.__setattr__(self, "allow_missing", allowed_missing(self.allow_missing))
        object.__setattr__(self, "optimizer_hparams", OptimizerHparams.parse(self.optimizer_hparams))
        if self.key_prefix is not None:
            check_key_prefix(self.key_prefix)
        if self.part_keys is not None:
            object.__setattr__(self, "part_keys", check_part_keys(self.part_keys))
        if self.broadcast_from_rank0 and self.map_location is not None:
            raise UsageError(
                f"ResumeOptions(map_location={self.map_location!r}, broadcast_from_rank0=True): the broadcast "
                "state arrives on the CPU and is copied into the model's and optimizer's own tensors, so there is "
                "nothing to map",
                hint="drop map_location, or broadcast_from_rank0 to let every rank read the file itself",
            )
