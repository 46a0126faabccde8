"""_foreign/sharded_load.py in one process: a sharded (or any DCP) folder read as its structure with meta stand-ins,
then its tensors loaded into given destinations through the in-place reader; damage named. The FSDP2 resume that
uses both is tests/dist/test_fsdp_resume.py."""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import dist_resume as dr
from dist_resume._core.tree import iter_tensors
from dist_resume._foreign.dcp_metadata import read_dcp_metadata
from dist_resume._foreign.sharded_load import load_into_shards, read_dcp_skeleton, read_sharded_skeleton
from dist_resume.errors import CheckpointCorruptError, NotACheckpointError


def _saved(tmp_path: Path) -> tuple[Path, dict]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.named_parameters(), lr=0.1)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    src = dr.save_checkpoint(tmp_path / "a.pt", model=model, optimizer=opt, step=3)
    folder = dr.tools.convert_checkpoint(src, tmp_path / "a.dcp", format="sharded").dst
    return Path(folder), torch.load(src, weights_only=True)


def test_a_sharded_folder_reads_as_stand_ins_then_fills_given_tensors(tmp_path: Path) -> None:
    folder, original = _saved(tmp_path)
    parts, keys = read_sharded_skeleton(folder)
    assert parts.layout.value == "dist_resume-sharded" and parts.step == 3
    model_tensors = list(parts.model.values())
    state_tensors = [t for s in parts.optimizer["state"].values() for t in s.values()]
    assert all(t.device.type == "meta" for t in model_tensors + state_tensors)  # no tensor data read
    assert [tuple(t.shape) for t in model_tensors] == [tuple(t.shape) for t in original["model"].values()]
    assert {id(t) for t in model_tensors + state_tensors} <= set(keys)
    assert parts.optimizer["param_groups"][0]["lr"] == 0.1  # DCP's objects are read for the plan
    assert keys[id(parts.model["0.weight"])] == "model.0.weight"

    targets = {keys[id(t)]: torch.full(t.shape, -1.0, dtype=t.dtype) for t in model_tensors + state_tensors}
    load_into_shards(folder, targets)  # no process group: DCP reads in this process
    for name, value in original["model"].items():
        assert torch.equal(targets[f"model.{name}"], value), name
    assert torch.equal(targets["optimizer.state.0.weight.exp_avg"], original["optimizer"]["state"][0]["exp_avg"])


def test_damage_found_while_filling_is_named_and_says_what_it_left(tmp_path: Path) -> None:
    folder, _ = _saved(tmp_path)
    parts, keys = read_sharded_skeleton(folder)
    storage = read_dcp_metadata(folder).storage_data
    (info,) = [v for k, v in storage.items() if k.fqn == "model.1.weight"]
    with open(folder / info.relative_path, "r+b") as f:  # the chunk's local zip header
        f.seek(info.offset)
        f.write(b"\xff\xff")
    stand_in = parts.model["1.weight"]
    with pytest.raises(CheckpointCorruptError, match="may hold part of it") as caught:
        load_into_shards(folder, {keys[id(stand_in)]: torch.empty(stand_in.shape)})
    assert info.relative_path in str(caught.value)


def test_damage_in_another_ranks_copy_names_that_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    import dist_resume._foreign.sharded_load as sharded_load

    folder, _ = _saved(tmp_path)
    parts, keys = read_sharded_skeleton(folder)

    def rank1_fails(*args: object, **kwargs: object) -> None:  # as DCP gathers it on rank 0 of 2
        failure = (UnicodeDecodeError("utf-8", b"\xcc", 0, 1, "bad byte"), traceback.StackSummary())
        raise CheckpointException("load", {1: failure})

    monkeypatch.setattr("torch.distributed.checkpoint.state_dict_loader.load", rank1_fails)
    monkeypatch.setattr(sharded_load, "_world", lambda: 2)
    stand_in = parts.model["1.weight"]
    with pytest.raises(CheckpointCorruptError, match=r"rank\(s\) \[1\] could not read their part") as caught:
        load_into_shards(folder, {keys[id(stand_in)]: torch.empty(stand_in.shape)})
    assert caught.value.rank == 1 and "copy the whole folder to those ranks' nodes" in str(caught.value)
    assert str(folder) not in str(caught.value)  # rank 0's intact copy is not blamed


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_any_dcp_folder_reads_as_read_dcp_splits_it(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=tmp_path / "d")
    parts, keys = read_dcp_skeleton(tmp_path / "d")
    assert parts.layout.value == "dcp" and sorted(parts.model) == ["bias", "weight"]
    assert set(parts.optimizer["state"]) == {0, 1}  # DCP's digit strings back to ids
    assert all(t.device.type == "meta" and id(t) in keys for t in iter_tensors(parts.model))
    with pytest.raises(NotACheckpointError, match="is not a DCP folder"):
        read_dcp_skeleton(tmp_path)
