"""Which tensors of a checkpoint a restore can copy: dense (strided) ones, in the words every refusal of the others uses.

``torch.load(weights_only=True)`` rebuilds sparse (COO, CSR, CSC, BSR, BSC), nested and quantized tensors, and meta
tensors (saved without data), as readily as dense ones. ``state_dict()`` of a dense model or optimizer writes none of
them, and none can be copied into a dense tensor: ``copy_`` fails on the first one, after the tensors before it were
overwritten. The readers name each such tensor before anything uses it (:func:`odd_tensors`).
"""

from __future__ import annotations

from typing import Any

import torch

from .tree import iter_tensors, named_tensors

__all__ = ["tensor_kind", "odd_tensors"]


def tensor_kind(tensor: torch.Tensor, *, stand_ins: bool = True) -> str | None:
    """None for a dense tensor (strided layout, neither nested nor quantized), else its kind in words. Local.

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
