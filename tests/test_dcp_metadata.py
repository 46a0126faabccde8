"""DCP ``.metadata`` unpickling: only DCP's own classes, and ``getattr`` only for an allowed enum's member."""

from __future__ import annotations

import io
import os
import pickle

import pytest
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

from dist_resume._foreign.dcp_metadata import _MetadataUnpickler


class _ByGetattr:
    """Pickles as ``getattr(target, name)``, as Python 3.11.2's enum members do (3.11.7 pickles them by value)."""

    def __init__(self, target: object, name: str) -> None:
        self.target, self.name = target, name

    def __reduce__(self) -> tuple[object, tuple[object, str]]:
        return (getattr, (self.target, self.name))


def _load(obj: object) -> object:
    return _MetadataUnpickler(io.BytesIO(pickle.dumps(obj, protocol=4))).load()


def test_an_enum_member_pickled_through_getattr_loads():
    member = next(iter(_MEM_FORMAT_ENCODING))
    assert _load(_ByGetattr(_MEM_FORMAT_ENCODING, member.name)) is member


@pytest.mark.parametrize(
    ("target", "name"), [(os.PathLike, "register"), (_MEM_FORMAT_ENCODING, "__class__"), (str, "join")]
)
def test_getattr_reaches_nothing_else(target, name):
    with pytest.raises(pickle.UnpicklingError, match="not part of DCP metadata"):
        _load(_ByGetattr(target, name))
