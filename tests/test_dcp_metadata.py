"""DCP ``.metadata`` unpickling: only DCP's own classes, and ``getattr`` only for an allowed enum's member; the torch-free
reader's view of it is torch's."""

from __future__ import annotations

import io
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

from dist_resume._foreign.dcp_metadata import _MetadataUnpickler
from dist_resume._format.dcp.entries import entries_problem
from dist_resume._format.dcp.peek import DTYPE_SIZES, peek_dcp_metadata
from dist_resume._format.dcp.view import BadMetadata, metadata_problem, view_of, view_problem
from dist_resume._format.records import check_zip_stream
from dist_resume.errors import CheckpointCorruptError


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


# ---- what a .metadata promises about its storage entries and the entries themselves (issue 28) ---------------------


def _saved(folder: Path) -> tuple[Any, dict[str, int]]:
    """A small DCP save (two tensors of one shape, one of another, an object) and its data files' sizes."""
    import torch.distributed.checkpoint as dcp

    state: dict[str, dict[str, Any]] = {
        "model": {"w": torch.arange(24.0).view(4, 6), "b": torch.ones(4)},
        "optimizer": {"m": torch.zeros(4, 6), "lr": 0.1},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch.distributed is disabled: saving in one process
        dcp.save(state, checkpoint_id=folder, no_dist=True)
    sizes = {p.name: p.stat().st_size for p in folder.glob("*.distcp")}
    return pickle.loads((folder / ".metadata").read_bytes()), sizes


def _storage(metadata: Any, fqn: str) -> Any:
    return next(info for index, info in metadata.storage_data.items() if index.fqn == fqn)


def _problem(metadata: Any, sizes: dict[str, int]) -> str | None:
    """What the torch path's view and the torch-free reader's view of ``metadata`` find wrong: the same."""
    data = pickle.dumps(metadata)
    found = []
    for read in (pickle.loads, peek_dcp_metadata):
        try:
            found.append(view_problem(view_of(read(data)), sizes))
        except BadMetadata as err:
            found.append(str(err))
    assert found[0] == found[1]
    return found[0]


def test_a_sound_save_passes(tmp_path):
    metadata, sizes = _saved(tmp_path)
    assert _problem(metadata, sizes) is None


@pytest.mark.parametrize("same_shape", [True, False])
def test_storage_entries_that_share_bytes_are_refused_naming_both(tmp_path, same_shape):
    """One entry pointed at another's bytes (of a tensor of the same shape: every reader would restore the other
    tensor's values without a word)."""
    metadata, sizes = _saved(tmp_path)
    w, other = _storage(metadata, "model.w"), _storage(metadata, "optimizer.m" if same_shape else "model.b")
    w.offset, w.length = other.offset, other.length
    problem = str(_problem(metadata, sizes))
    assert "share bytes" in problem and "'model.w'" in problem, problem
    assert ("'optimizer.m'" if same_shape else "'model.b'") in problem


def test_a_transform_torch_cannot_undo_is_refused(tmp_path):
    metadata, sizes = _saved(tmp_path)
    _storage(metadata, "model.w").transform_descriptors = ["zstd"]
    assert "the storage entry of 'model.w' has the transforms ['zstd']" in str(_problem(metadata, sizes))
    _storage(metadata, "model.w").transform_descriptors = ["stream.zstd/1"]  # what torch writes: read by torch
    assert view_of(pickle.loads(pickle.dumps(metadata))).stored[("model.w", (0, 0))].transforms == ("stream.zstd/1",)


def test_an_entry_whose_declaration_was_lost_is_refused(tmp_path):
    """``state_dict_metadata`` lost a key that the planner and the storage entries still name: internally
    inconsistent, so damage (not a model that does not fit)."""
    metadata, sizes = _saved(tmp_path)
    del metadata.state_dict_metadata["model.b"]
    assert "planner_data places 'model.b', which has no entry" in str(_problem(metadata, sizes))
    del metadata.planner_data["model.b"]
    assert "the storage entry of 'model.b' at (0,) names no tensor chunk or object" in str(_problem(metadata, sizes))


def _shrink(md: Any) -> None:
    """A one-chunk tensor of 4 elements declared 2 long, its chunk too."""
    md.size = md.chunks[0].sizes = torch.Size([2])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize(
    ("edit", "found"),
    [
        (lambda m: setattr(m.state_dict_metadata["model.w"].properties, "dtype", torch.int64), "float32 of shape"),
        (lambda m: setattr(m.state_dict_metadata["model.w"].properties, "dtype", torch.float64), "float32 of shape"),
        (lambda m: _shrink(m.state_dict_metadata["model.b"]), "shape (4,)"),
    ],
    ids=["int64", "float64", "shrunk"],
)
def test_a_stored_chunk_unlike_its_declaration_is_refused_by_header_and_by_every_read(tmp_path, edit, found):
    """``.metadata`` declares another dtype or a smaller shape than the entry holds: the deep check reads each entry's
    header and says so without reading tensor data; a reader that reads it anyway (a plain DCP folder has no deep
    check before the read) refuses it naming the file and the key, instead of restoring a cast or cut value."""
    import dist_resume as dr

    metadata, sizes = _saved(tmp_path)
    edit(metadata)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(metadata))
    view = view_of(metadata)
    assert view_problem(view, sizes) is None  # consistent in itself: only the entries show it
    problem = str(entries_problem(tmp_path, view, sizes))
    assert found in problem and "in '__0_0.distcp'" in problem, problem
    with pytest.raises(CheckpointCorruptError, match=r"__0_0\.distcp'?: the entry of 'model\.[wb]'") as caught:
        dr.load_checkpoint(tmp_path, map_location="cpu")
    assert found.split(" of shape")[0] in str(caught.value)


def test_an_object_entry_with_a_damaged_pickle_is_found_by_its_header(tmp_path):
    """``torch.load`` never checks a record's CRC-32: an object entry whose ``data.pkl`` changed is found by the deep
    check's read of each entry's header."""
    metadata, sizes = _saved(tmp_path)
    info = _storage(metadata, "optimizer.lr")
    shard = tmp_path / info.relative_path
    data = bytearray(shard.read_bytes())
    entry = bytes(data[info.offset : info.offset + info.length])
    record = next(r for r in check_zip_stream(io.BytesIO(entry), len(entry), "x") if r.name.endswith("/data.pkl"))
    data[info.offset + record.data_offset + record.compress_size - 2] ^= 0x01  # a byte of the pickle (not STOP)
    shard.write_bytes(bytes(data))
    assert "optimizer.lr" in str(entries_problem(tmp_path, view_of(metadata), sizes))
