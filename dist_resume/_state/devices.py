"""Finding tensors on the wrong device, in words a user can act on."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from .._core.errors import DeviceMismatchError
from .._core.text import preview
from .._core.tree import named_tensors
from .optim.placement import step_on_param_device
from .optim.prepare import param_names

__all__ = ["device_report", "check_devices", "check_first_step"]

_FIX_OPTIMIZER = (
    "move the model to its device before building the optimizer and loading its state, "
    "or call dist_resume.optimizer_to(optimizer) after model.to(device)"
)
# optimizers that create ``step`` on the parameter's device themselves, capturable or not
_STEP_ON_PARAM_DEVICE = (torch.optim.ASGD,)
_FIX_BATCH = "move every batch to the model's device (batch.to(device)) inside the training loop"


def device_report(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, batch: Any = None, errors_only: bool = False
) -> list[str]:
    """Every tensor that sits on a different device than it must, as one sentence each.

    Local; changes nothing. Checks each optimizer state tensor against its parameter (``step``
    belongs on the CPU unless the group is fused or capturable) and, when ``batch`` is given, each
    tensor in it against the model's parameters. An empty list means all is in place. ``errors_only``: only what
    torch's ``step()`` would fail on (not a ``step`` torch merely keeps elsewhere).

    Example::

        >>> model = torch.nn.Linear(2, 2)
        >>> dist_resume.tools.device_report(model, torch.optim.SGD(model.parameters(), lr=0.1))
        []
    """
    findings = []
    if optimizer is not None:
        names = param_names(model)
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p) or {}
                name = names.get(id(p), f"<parameter {tuple(p.shape)} not in the model>")
                host_scalars = not step_on_param_device(group)
                for key, entry in state.items():
                    # LBFGS keeps lists of tensors: look inside, as torch's load_state_dict does
                    for where, value in named_tensors(entry, f"optimizer.state[{name}][{key!r}]"):
                        if host_scalars and value.dim() == 0 and value.device.type == "cpu":
                            continue  # torch hosts step (and NAdam's mu_product) there; CPU scalars mix with any device
                        if key == "step" and host_scalars and not isinstance(optimizer, _STEP_ON_PARAM_DEVICE):
                            if value.device.type != "cpu" and not errors_only:
                                findings.append(
                                    f"{where} is on {value.device}; torch keeps it on cpu "
                                    "for a group that is neither fused nor capturable (a host sync every step)"
                                )
                        elif value.device != p.device:
                            findings.append(f"{where} is on {value.device}, its parameter on {p.device}")
    if batch is not None:
        devices = {p.device for p in model.parameters()}
        if len(devices) == 1:
            (model_device,) = devices
            for path, tensor in named_tensors(batch, "batch"):
                if tensor.device != model_device:
                    findings.append(f"{path} is on {tensor.device}, the model on {model_device}")
    return findings


def check_devices(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, batch: Any = None) -> None:
    """Raise :class:`DeviceMismatchError` naming every misplaced tensor and the fix.

    Local. Call it after resuming, before the first step: it turns the late
    ``Expected all tensors to be on the same device`` into an error that says which tensor.

    Example::

        >>> model = torch.nn.Linear(2, 2)
        >>> dist_resume.check_devices(model, torch.optim.Adam(model.parameters()))  # passes
    """
    findings = device_report(model, optimizer, batch=batch)
    if not findings:
        return
    fixes = []
    if any(f.startswith("optimizer") for f in findings):
        fixes.append(_FIX_OPTIMIZER)
    if any(f.startswith("batch") for f in findings):
        fixes.append(_FIX_BATCH)
    shown = preview(findings, 10, sep="\n  ", quote=False)
    raise DeviceMismatchError(
        f"{len(findings)} tensor(s) on the wrong device:\n  {shown}\nwhat to do: {'; '.join(fixes)}",
        findings=findings,
    )


_GUARDS: weakref.WeakKeyDictionary[torch.optim.Optimizer, Any] = weakref.WeakKeyDictionary()


def check_first_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Check, at the optimizer's next ``step()``, that every state tensor is on its parameter's device. Local.

    A step pre-hook, removed once a step passed the check: after a resume, the state sits where the parameters
    were; a ``model.to(device)`` after the resume (resuming first is the usual mistake) leaves it behind, and torch's
    kernels would fail with ``Expected all tensors to be on the same device``, naming no tensor. This raises
    :class:`DeviceMismatchError` naming each tensor and the fix instead (and checks again at the next step).
    """
    previous = _GUARDS.pop(optimizer, None)
    if previous is not None:
        previous.remove()

    def check(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        findings = device_report(model, opt, errors_only=True)
        if findings:
            shown = preview(findings, 10, sep="\n  ", quote=False)
            raise DeviceMismatchError(
                f"the first optimizer.step() after resume found {len(findings)} state tensor(s) on another device "
                f"than their parameter:\n  {shown}\nthe model was moved after the resume; resume after "
                "model.to(device), or call dist_resume.optimizer_to(optimizer) after moving it",
                findings=findings,
            )
        handle = _GUARDS.pop(opt, None)
        if handle is not None:
            handle.remove()

    _GUARDS[optimizer] = optimizer.register_step_pre_hook(check)
