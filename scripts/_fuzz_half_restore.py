"""The fuzz worker's ``half-restore`` check: a resume that raises must leave every live object and the RNG streams as
they were before it. :func:`all_or_nothing` runs a resume and, when it raises, notes in :data:`CHANGED` every part
it left changed; the worker turns a refusal with a change into a ``half-restore`` outcome."""

from __future__ import annotations

from typing import Any, cast

CHANGED: list[str] = []  # what a failed resume of the current case left changed (a half-restore)


def _fingerprint(objs: dict[str, Any]) -> dict[str, Any]:
    """Copies of everything a resume may change: each object's state dict, the RNG streams."""
    import copy
    import random

    import numpy as np
    import torch

    out: dict[str, Any] = {name: copy.deepcopy(obj.state_dict()) for name, obj in objs.items()}
    out["optimizer tensors"] = (
        [id(t) for s in objs["optimizer"].state.values() for t in s.values()] if "optimizer" in objs else []
    )
    out["rng"] = (torch.get_rng_state(), random.getstate(), cast(tuple[Any, ...], np.random.get_state())[1].copy())
    return out


def _differs(a: Any, b: Any) -> bool:
    import numpy as np
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return not (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, np.ndarray):
        return not (isinstance(b, np.ndarray) and np.array_equal(a, b))
    if isinstance(a, dict):
        return not isinstance(b, dict) or a.keys() != b.keys() or any(_differs(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return not isinstance(b, (list, tuple)) or len(a) != len(b) or any(map(_differs, a, b))
    return bool(a != b)


def all_or_nothing(objs: dict[str, Any], resume: Any) -> None:
    """``resume()``; when it raises, note in ``CHANGED`` every part that is not as it was before."""
    before = _fingerprint(objs)
    try:
        resume()
    except BaseException:
        after = _fingerprint(objs)
        CHANGED.extend(k for k in before if _differs(before[k], after[k]))
        raise
