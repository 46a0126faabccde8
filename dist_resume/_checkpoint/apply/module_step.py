"""The modules in apply: which load can raise (then it is a step, with a copy to put back), which is written at the
commit (no copy), and the hooks an FSDP2 resume refuses."""

from __future__ import annotations

import copy
from typing import Any, Final

import torch
from torch import nn

from ..._core.errors import UsageError
from ..._core.text import preview
from .inplace import fits
from .step import Pairs, Step

__all__ = ["can_raise", "refuse_load_hooks", "module_pairs", "module_step"]

_EXTRA: Final = "_extra_state"  # the state_dict key of nn.Module.get_extra_state()


def can_raise(module: nn.Module) -> bool:
    """Whether ``module``'s load can raise once the plan validated its keys, shapes and dtypes: a load hook, or a
    ``load_state_dict`` (of ``module`` itself), ``_load_from_state_dict`` or ``set_extra_state`` not torch.nn's own
    (quantized layers, an override)."""
    if _overridden(module, "load_state_dict"):
        return True
    for m in module.modules():
        if m._load_state_dict_pre_hooks or m._load_state_dict_post_hooks:
            return True
        if _overridden(m, "_load_from_state_dict") or _overridden(m, "set_extra_state"):
            return True
    return False


def _overridden(module: nn.Module, method: str) -> bool:
    return method in vars(module) or not getattr(type(module), method).__module__.startswith("torch.nn.")


def refuse_load_hooks(module: nn.Module, source: str) -> None:
    """Raise :class:`UsageError` if a submodule has a load-state-dict hook other than torch's own (FSDP2 registers
    some): an FSDP2 resume fills the shards in place, without ``load_state_dict``, so such a hook would not run."""
    found = []
    for name, m in module.named_modules():
        for hook in (*m._load_state_dict_pre_hooks.values(), *m._load_state_dict_post_hooks.values()):
            fn = getattr(hook, "hook", hook)  # pre-hooks are wrapped with their module
            if not str(getattr(fn, "__module__", "")).startswith("torch."):
                found.append(f"{name or type(m).__name__}: {getattr(fn, '__qualname__', repr(fn))}")
    if found:
        raise UsageError(
            f"{source}: the FSDP2 model has load_state_dict hooks ({preview(found, 3)}); an FSDP2 resume writes "
            "the checkpoint into the shards in place, without load_state_dict, so they would not run: nothing was "
            "restored",
            hint="remove the hooks before resume (apply what they do to the model after it), or resume into the "
            "unsharded model and shard it afterwards",
        )


def module_pairs(module: nn.Module, state: dict[str, Any]) -> Pairs:
    """``(saved tensor, live tensor)`` for each entry of ``state`` whose data can be written straight into the
    module's own tensor (same shape and dtype, contiguous)."""
    live = module.state_dict(keep_vars=True)
    return [(value, live[key].detach()) for key, value in state.items() if fits(value, live.get(key))]


def module_step(name: str, module: nn.Module, state: dict[str, Any], strict: bool) -> Step:
    """``module.load_state_dict`` for a module whose own load can raise (:func:`can_raise`): run before the ranks
    agree, so undo copies back a CPU copy of each tensor it overwrites, and its modules' extra state."""

    def save() -> tuple[list[tuple[torch.Tensor, torch.Tensor]], dict[str, Any]]:
        live = module.state_dict(keep_vars=True)
        tensors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        extras: dict[str, Any] = {}
        for key in state:
            value = live.get(key)
            if isinstance(value, torch.Tensor):
                if id(value) not in tensors:
                    tensors[id(value)] = (value.detach(), value.detach().to("cpu", copy=True))
            elif key.endswith(_EXTRA) and key in live:
                extras[key[: -len(_EXTRA)].rstrip(".")] = copy.deepcopy(value)
        return list(tensors.values()), extras

    def do() -> None:
        module.load_state_dict(state, strict=strict)

    def undo(saved: tuple[list[tuple[torch.Tensor, torch.Tensor]], dict[str, Any]]) -> None:
        tensors, extras = saved
        for path, extra in extras.items():
            module.get_submodule(path).set_extra_state(extra)
        with torch.no_grad():
            for live, old in tensors:
                live.copy_(old)

    return Step(name, save, do, undo)
