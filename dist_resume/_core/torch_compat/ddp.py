"""DDP's gradient buckets: what dist_resume relies on that torch does not promise (checked on torch 2.13).

``DistributedDataParallel`` reduces its first iteration in ONE bucket (``compute_bucket_size_limits`` gives
``[sys.maxsize]`` unless ``find_unused_parameters``, or the caps of ``bucket_cap_mb_list``), then, at the next
forward, rebuilds its buckets in the order the gradients became ready (FACTS 42). Past 2 ranks an all-reduce adds
each element in an order set by its place in its bucket, so a DDP built at a resume reduces its first step in other
sums than the uninterrupted run's same step. The rebuilt layout can be read (the reducer's logging data) and given
to a new reducer before the first step (FACTS 47): that reducer reduces its first step exactly as the uninterrupted
run's, and rebuilds to the same layout from the same ready order at the next forward.

What is private here: the reducer's logging data (``rebuilt_per_bucket_param_indices``, recorded when the logger
samples an iteration: the first ten, then every ``ddp_runtime_logging_sample_rate``; a rebuild at the second forward
is after that forward's sample, so it is logged on demand), ``DistributedDataParallel``'s attributes that
``_ddp_init_helper`` reads to build its reducer (its ``__setstate__`` builds one anew the same way), and
``Reducer._remove_autograd_hooks``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["BucketLayout", "bucket_layout_of", "find_ddp", "ddp_started", "unsupported_reason", "install_layout"]

BucketLayout = tuple[tuple[int, ...], ...]
"""The reducer's parameter indices, bucket by bucket, in reduction order (indices into the parameters DDP reduces)."""

_INSTALLED = "_dist_resume_bucket_layout"  # set on a DDP whose reducer this module built, until it rebuilds


def find_ddp(model: nn.Module) -> Any:
    """The ``DistributedDataParallel`` that ``model`` is or wraps (``torch.compile`` around it), or None."""
    from torch.nn.parallel import DistributedDataParallel

    from .private import compiled_original

    while not isinstance(model, DistributedDataParallel):
        inner = compiled_original(model)
        if inner is None:
            return None
        model = inner
    return model


def ddp_started(ddp: Any) -> bool:
    """Whether ``ddp`` ran a forward pass (``_lazy_init_ran``, set by the first ``_pre_forward``)."""
    return bool(getattr(ddp, "_lazy_init_ran", True))


def _parse(text: str) -> BucketLayout:
    return tuple(tuple(int(i) for i in bucket.split()) for bucket in text.split(","))


def bucket_layout_of(ddp: Any) -> BucketLayout | None:
    """The layout ``ddp`` reduces in once rebuilt: the one it rebuilt, or the one :func:`install_layout` gave it
    (not rebuilt since); None before its rebuild (its next step is its first: one bucket, as any new DDP's)."""
    if not getattr(ddp, "_has_rebuilt_buckets", False):
        installed: BucketLayout | None = getattr(ddp, _INSTALLED, None)
        if installed is not None or not ddp_started(ddp) or not _rebuild_now(ddp):
            return installed
    text = ddp._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices")
    if text is None and ddp.logger is not None:  # rebuilt after the last sampled iteration: sample this one
        ddp.logger.set_runtime_stats_and_log()
        text = ddp._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices")
    return None if text is None else _parse(str(text))


def _rebuild_now(ddp: Any) -> bool:
    """Rebuild ``ddp``'s buckets now, as its next forward would (``Reducer._rebuild_buckets``, from the ready order
    its first backward recorded); whether it did. After one step the run's next step reduces in the rebuilt layout,
    so that is the layout to save; rebuilt here or at that forward, the buckets are the same."""
    try:
        rebuilt = bool(ddp.reducer._rebuild_buckets())
    except RuntimeError:  # a backward still pending (a save between forward and backward): leave it to the forward
        return False
    if rebuilt:
        ddp._has_rebuilt_buckets = True
    return rebuilt


def unsupported_reason(ddp: Any) -> str | None:
    """Why a new reducer cannot be given to ``ddp`` as it stands, or None."""
    if getattr(ddp, "_use_python_reducer", False):
        return "it uses the Python reducer (compiled autograd)"
    if getattr(ddp, "_delay_all_reduce_all_params", False):
        return "every parameter's all-reduce is delayed (param_to_hook_all_reduce)"
    if getattr(ddp, "mixed_precision", None) is not None:
        return "it uses DDP's mixed_precision"
    if getattr(ddp, "reducer", None) is None or getattr(ddp, "logger", None) is None:
        return "it has no reducer"
    hook = ddp._get_ddp_logging_data().get("comm_hook")
    if hook and not getattr(ddp, "_comm_hooks", None):
        return f"its built-in comm hook ({hook}) cannot be registered again"
    return None


def reduced_parameters(ddp: Any) -> list[torch.Tensor]:
    """The parameters ``ddp``'s reducer reduces, in its index order."""
    parameters, _ = ddp._build_params_for_reducer()
    return list(parameters)


def install_layout(ddp: Any, layout: BucketLayout) -> None:
    """Give ``ddp`` a new reducer whose buckets are ``layout`` (checked by the caller: a permutation of the reduced
    parameters' indices), its comm hooks and static-graph mode carried over. Local. The new reducer is built (and
    registers its autograd hooks) before the old one's hooks are removed: a failure changes nothing."""
    parameters, expect_sparse = ddp._build_params_for_reducer()
    sizes = [sum(parameters[i].numel() * parameters[i].element_size() for i in bucket) for bucket in layout]
    config = ddp._bucket_config
    _, rebuild_limits = config.compute_bucket_size_limits(
        static_graph=ddp.static_graph, find_unused_parameters=ddp.find_unused_parameters
    )
    reducer = dist.Reducer(
        parameters,
        [list(bucket) for bucket in layout],
        sizes,
        ddp.process_group,
        expect_sparse,
        ddp.bucket_bytes_cap,
        ddp.find_unused_parameters,
        ddp.gradient_as_bucket_view,
        ddp._build_debug_param_to_name_mapping(parameters),
        config.first_bucket_bytes_cap,
        ddp.skip_all_reduce_unused_params,
        ddp._use_python_reducer,
        rebuild_limits,
        ddp.batched_grad_copy,
    )
    try:
        logger = dist.Logger(reducer)
        reducer.set_logger(logger)
        logger.set_construction_data_and_log(
            ddp.module.__class__.__name__,
            [] if ddp.device_ids is None else ddp.device_ids,
            -1 if ddp.output_device is None else ddp.output_device,
            ddp.forward_sync_buffers,
            any(isinstance(m, nn.SyncBatchNorm) for m in ddp.module.modules()),
            ddp.static_graph,
        )
        if ddp.static_graph:
            reducer._set_static_graph()
            logger._set_static_graph()
        for hook, state in ddp._comm_hooks:
            logger._set_comm_hook_name(hook.__qualname__)
            dist._register_comm_hook(reducer, state, hook)
    except BaseException:
        reducer._remove_autograd_hooks()  # the old reducer stays, alone
        raise
    ddp.reducer._remove_autograd_hooks()
    ddp.reducer, ddp.logger = reducer, logger
    setattr(ddp, _INSTALLED, layout)
