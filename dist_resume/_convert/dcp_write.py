"""Writing a DCP folder from one process (``convert --format dcp`` and ``--format sharded``): only tensors DCP can
write, and DCP's failures as this toolkit's errors."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from .._core.errors import CheckpointWriteError, NotACheckpointError
from .._core.tensor_kind import odd_tensors
from .._core.text import preview
from .._core.torch_compat.wording import dcp_cause, error_summary

__all__ = ["write_dcp"]


def write_dcp(state: dict[str, Any], folder: Path, source: str) -> None:
    """``torch.distributed.checkpoint.save(state)`` into ``folder``, by this one process. Local.

    A tensor DCP cannot write or read back (sparse, nested, quantized, or meta: no data) raises
    :class:`NotACheckpointError` naming it, before anything is written. A failure inside DCP (which wraps it in
    ``CheckpointException``, a ``BaseException``) is raised as the exception DCP wrapped: an ``OSError`` (the caller
    reports it as a write failure), this toolkit's own error, or what it is; never as the ``BaseException``.
    """
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    odd = odd_tensors(state, stand_ins=False)
    if odd:
        raise NotACheckpointError(
            f"{source} holds tensors that a DCP folder cannot hold ({preview(odd, quote=False, count=True)}); "
            "no state_dict() of a dense model writes them: make them dense (.to_dense()) or drop them, re-save the "
            "file and convert it again"
        )
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp_save(state, checkpoint_id=folder, no_dist=True)
    except CheckpointException as err:
        cause = dcp_cause(err)
        if isinstance(cause, Exception):
            raise cause from err
        raise CheckpointWriteError(f"torch.distributed.checkpoint.save failed ({error_summary(cause)})") from err
