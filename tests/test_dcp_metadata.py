"""DCP ``.metadata`` unpickling: only DCP's own classes, and ``getattr`` only for an allowed enum's member; the torch-free
reader's view of it is torch's."""

from __future__ import annotations

import io
import os
import pickle

import pytest
import torch
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

from dist_resume._foreign.dcp_metadata import _MetadataUnpickler
from dist_resume._format.dcp_peek import DTYPE_SIZES, peek_dcp_metadata
from dist_resume._format.dcp_view import BadMetadata, metadata_problem, view_of, view_problem


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


def test_the_torch_free_reader_knows_every_dtype_and_its_size():
    names = {n for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)}
    assert set(DTYPE_SIZES) == names
    assert {n: getattr(torch, n).itemsize for n in names} == {n: DTYPE_SIZES[n] for n in names}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_the_torch_free_reader_sees_what_torch_s_does(tmp_path):
    """One walk (view_of) over DCP's real Metadata and over the stand-ins the torch-free reader builds: the same
    view, for a nested state with lists (an optimizer's groups), objects and several dtypes."""
    import torch.distributed.checkpoint as dcp

    state = {
        "model": {"w": torch.ones(3, 2), "h": torch.zeros(4, dtype=torch.bfloat16), "n": torch.tensor(7)},
        "optimizer": {"param_groups": [{"lr": 0.1, "params": ["w"]}], "state": {"w": {"step": torch.tensor(3.0)}}},
    }
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    data = (tmp_path / ".metadata").read_bytes()
    real = view_of(pickle.loads(data))  # torch's own file, written here
    assert view_of(peek_dcp_metadata(data)) == real
    sizes = {p.name: p.stat().st_size for p in tmp_path.glob("*.distcp")}
    assert view_problem(real, sizes) is None
    assert real.places["optimizer.param_groups.0.lr"] == ("optimizer", "param_groups", 0, "lr")
    assert metadata_problem(data, sizes, ["model", "optimizer"]) is None
    assert "the manifest ['model']" in str(metadata_problem(data, sizes, ["model"]))
    shrunk = {name: size - 1 for name, size in sizes.items()}
    assert "run past the end" in str(view_problem(real, shrunk))


def test_a_storage_entry_that_lost_a_field_is_refused_by_name(tmp_path):
    """A `.metadata` whose `_StorageInfo` lost a field (seed 7's fuzz run: one flipped byte in a field name): the
    refusal names the entry, and does not call its `repr`, which raises for a dataclass missing a field."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(3)}, checkpoint_id=tmp_path, no_dist=True)
    data = (tmp_path / ".metadata").read_bytes()
    assert data.count(b"relative_path") == 1
    damaged = data.replace(b"relative_path", b"relative_patH")
    sizes = {p.name: p.stat().st_size for p in tmp_path.glob("*.distcp")}
    for metadata in (pickle.loads(damaged), peek_dcp_metadata(damaged)):
        with pytest.raises(BadMetadata, match="the storage entry of 'w' is "):
            view_of(metadata)
    assert "the storage entry of 'w'" in str(metadata_problem(damaged, sizes, ["w"]))
