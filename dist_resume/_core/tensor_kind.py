"""Which tensors of a checkpoint a restore can copy: dense (strided) ones, in the words every refusal of the others uses.

``torch.load(weights_only=True)`` rebuilds sparse (COO, CSR, CSC, BSR, BSC), nested and quantized tensors, and meta
tensors (saved without data), as readily as dense ones. ``state_dict()`` of a dense model or optimizer writes none of
them, and none can be copied into a dense tensor: ``copy_`` fails on the first one, after the tensors before it were
overwritten. Nor does it write a tensor whose elements share memory (``expand``, a stride of 0): a file of a few
kilobytes can hold one of 10**8 elements over one stored number, and whatever walks its elements (``tuple()``,
``contiguous()``, ``==``) pays for all of them (21 s and 5.4 GB for 10**7 elements). The readers name each such tensor
by its kind, from its shape and strides alone, before anything touches its elements (:func:`odd_tensors`,
:func:`refuse_odd_tensors`); the savers refuse to write one (``_save/saveable.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import NotACheckpointError
from .strides import overlapping
from .text import preview
from .tree import iter_tensors, named_tensors

__all__ = ["tensor_kind", "odd_tensors", "refuse_odd_tensors"]


def tensor_kind(tensor: torch.Tensor, *, stand_ins: bool = True) -> str | None:
    """None for a dense tensor (strided layout, neither nested nor quantized, no two elements in one place), else its
    kind in words. Local; reads no element.

    ``stand_ins``: a meta tensor (shape and dtype, no data) counts as dense, a stand-in whose data comes later (a
    broadcast, a read by ranges, a zip's structure read alone); without it, it is ``"a meta tensor, without data"``.

    Example::

        >>> tensor_kind(torch.zeros(2)), tensor_kind(torch.zeros(2).to_sparse())
        (None, 'a sparse_coo tensor')
    """
    if tensor.is_nested:  # before the layout: a nested tensor's is torch.strided (or torch.jagged)
        return "a nested tensor"
    if tensor.layout != torch.strided:
        return f"a {str(tensor.layout).removeprefix('torch.')} tensor"
    if tensor.is_quantized:
        return "a quantized tensor"
    # (a contiguous tensor never overlaps: the common case costs one call; a meta stand-in keeps the saved strides)
    if not tensor.is_contiguous() and overlapping(tensor.shape, tensor.stride()):
        return "an expanded tensor, its elements sharing memory"
    if tensor.is_meta and not stand_ins:
        return "a meta tensor, without data"
    return None


def odd_tensors(obj: Any, prefix: str = "", *, stand_ins: bool = True) -> list[str]:
    """``"<path> (<kind>)"`` for each tensor inside ``obj`` that is not dense (:func:`tensor_kind`), depth first. Local.

    Example::

        >>> odd_tensors({"w": torch.zeros(2), "b": torch.zeros(2).to_sparse()}, "model")
        ["model['b'] (a sparse_coo tensor)"]
    """
    if all(tensor_kind(t, stand_ins=stand_ins) is None for t in iter_tensors(obj)):  # the common case: no paths built
        return []
    out = []
    for path, tensor in named_tensors(obj, prefix):
        kind = tensor_kind(tensor, stand_ins=stand_ins)
        if kind is not None:
            out.append(f"{path} ({kind})")
    return out


def refuse_odd_tensors(obj: Any, source: str, prefix: str = "", *, stand_ins: bool = True) -> None:
    """Raise :class:`~dist_resume.errors.NotACheckpointError` naming the tensors of ``obj`` that are not dense
    (:func:`odd_tensors`), read from ``source``. Local; reads no element.

    Example::

        >>> refuse_odd_tensors({"w": torch.zeros(1).expand(3)}, "checkpoint 'ckpt.pt'")
        Traceback (most recent call last):
        ...
        dist_resume.errors.NotACheckpointError: checkpoint 'ckpt.pt' holds tensors that are not dense ...
    """
    odd = odd_tensors(obj, prefix, stand_ins=stand_ins)
    if odd:  # a sparse tensor unpickles (its indices and values are meta), but has no one storage to name or copy
        raise NotACheckpointError(
            f"{source} holds tensors that are not dense ({preview(odd, quote=False, count=True)}), which no "
            "state_dict() of a dense model writes and dist_resume does not read without loading them; load it with "
            "torch.load, make them dense (.to_dense(), .contiguous()) or drop them, and re-save it"
        )
