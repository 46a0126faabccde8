"""The configuration of a :class:`~dist_resume.ResumableDistributedSampler`, validated once."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SamplerConfig"]


@dataclass(frozen=True, slots=True)
class SamplerConfig:
    """What a ResumableDistributedSampler is built with, validated once."""

    num_samples: int
    num_replicas: int
    rank: int
    shuffle: bool
    seed: int
    drop_last: bool

    def __post_init__(self) -> None:
        for name in ("num_samples", "num_replicas", "rank", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        for name in ("shuffle", "drop_last"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.num_samples < 1:
            raise ValueError(f"the dataset is empty (len {self.num_samples}); a sampler needs at least one sample")
        if self.num_replicas < 1 or not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"rank={self.rank} must be in 0..num_replicas-1 (num_replicas={self.num_replicas})")
        if self.drop_last and self.num_samples < self.num_replicas:
            raise ValueError(
                f"drop_last=True with {self.num_samples} samples and {self.num_replicas} ranks "
                "leaves every rank empty; use drop_last=False or fewer ranks"
            )
