"""DCP folders written by ``dcp.save``, read through torch's DCP reader without a process group."""

from __future__ import annotations

import dataclasses
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from dist_resume._core.errors import CheckpointCorruptError, UnsafeCheckpointError
from dist_resume._foreign.dcp import read_dcp
from dist_resume._foreign.folders import FolderKind, detect_folder, read_foreign_folder
from dist_resume._state.optim.keys import normalize_optimizer_state
from tests.interop._compare import assert_same, loads_into
from tests.interop.conftest import Saved, _tiny


def test_plain_dcp_save_comes_back_with_int_state_keys(dcp_plain: Saved) -> None:
    assert detect_folder(dcp_plain.path) is FolderKind.DCP
    parts = read_foreign_folder(dcp_plain.path, map_location="cpu")
    assert_same(dict(parts.model), dcp_plain.model, "model")
    assert_same(parts.optimizer, dcp_plain.optimizer, "optimizer")  # int keys, as saved
    model = _tiny()
    loads_into(torch.optim.AdamW(model.parameters(), lr=1e-2), parts.optimizer)
    assert parts.layout.value == "dcp"


def test_torch_own_conversion_has_digit_strings_that_load_state_dict_drops(dcp_plain: Saved, tmp_path: Path) -> None:
    # FACTS 21: the bug normalize_optimizer_state exists for; if torch fixes it, this test says so
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(dcp_plain.path, tmp_path / "plain.pt")
    converted = torch.load(tmp_path / "plain.pt", weights_only=True)["optim"]
    assert set(converted["state"]) == {"0", "1", "2", "3"}
    optimizer = torch.optim.AdamW(_tiny().parameters(), lr=1e-2)
    optimizer.load_state_dict(converted)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    assert not any(optimizer.state.get(p) for p in params)  # no parameter got state, and no error
    fixed = normalize_optimizer_state(converted)
    assert_same(fixed, dcp_plain.optimizer, "optimizer")
    loads_into(torch.optim.AdamW(_tiny().parameters(), lr=1e-2), fixed)


def test_dsd_fqn_keyed_optimizer_becomes_positions_with_param_names(dcp_dsd: Saved) -> None:
    parts = read_dcp(dcp_dsd.path, map_location="cpu")
    assert_same(dict(parts.model), dcp_dsd.model, "model")
    names = ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert parts.optimizer["param_groups"][0]["param_names"] == names
    assert parts.optimizer["param_groups"][0]["params"] == [0, 1, 2, 3]
    assert dcp_dsd.optimizer is not None
    assert_same(parts.optimizer["state"], dcp_dsd.optimizer["state"], "optimizer state")
    loads_into(torch.optim.AdamW(_tiny().parameters(), lr=1e-2), parts.optimizer)


def test_ambiguous_or_foreign_optimizer_state_is_left_alone() -> None:
    both = {"state": {0: {}, "0": {}}, "param_groups": [{"params": [0]}]}
    assert normalize_optimizer_state(both) is both
    assert normalize_optimizer_state(None) is None
    lbfgs_like = {"state": {"func_evals": 1}, "param_groups": [{"params": [0]}]}
    assert normalize_optimizer_state(lbfgs_like) is lbfgs_like


def test_truncated_distcp_is_a_corrupt_checkpoint(dcp_plain: Saved, tmp_path: Path) -> None:
    folder = tmp_path / "cut"
    shutil.copytree(dcp_plain.path, folder)
    data = next(folder.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(CheckpointCorruptError, match="distcp"):
        read_dcp(folder, map_location="cpu")


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("pwned",))


def test_metadata_with_foreign_globals_is_refused_unless_trusted(dcp_plain: Saved, tmp_path: Path) -> None:
    folder = tmp_path / "evil"
    shutil.copytree(dcp_plain.path, folder)
    (folder / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(UnsafeCheckpointError, match=r"builtins\.print"):
        read_dcp(folder, map_location="cpu")


@dataclasses.dataclass
class RunConfig:  # an object DCP pickles into its data files with torch.save
    lr: float = 0.1


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_entry_holding_an_object_is_refused_with_the_allowlist_fix(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": _tiny().state_dict(), "config": RunConfig()}, checkpoint_id=str(tmp_path / "cfg"), no_dist=True)
    with pytest.raises(UnsafeCheckpointError) as err:
        read_dcp(tmp_path / "cfg", map_location="cpu")
    message = str(err.value)
    assert message.startswith(
        f"DCP entry 'config' of {str(tmp_path / 'cfg')!r} cannot be loaded safely: it references "
    )
    assert "RunConfig" in message and "torch.serialization.add_safe_globals([RunConfig])" in message
    parts = read_dcp(tmp_path / "cfg", map_location="cpu", weights_only=False)  # trusted: it loads
    assert set(parts.model) == set(_tiny().state_dict())


def test_dcp_written_by_two_ranks_reads_whole(tmp_path: Path) -> None:
    from tests.dist.harness import run_ranks

    results = run_ranks(_save_two_ranks, 2, tmp_path=tmp_path, args=(str(tmp_path / "two"),))
    assert len(list((tmp_path / "two").glob("*.distcp"))) == 2
    parts = read_dcp(tmp_path / "two", map_location="cpu")
    model = _tiny()  # both ranks trained the same replica (same seed, same batches)
    assert set(parts.model) == set(model.state_dict())
    assert_same(parts.optimizer["state"], results[0]["state"], "optimizer state")
    loads_into(torch.optim.AdamW(model.parameters(), lr=1e-2), parts.optimizer)


def _save_two_ranks(rank: int, world_size: int, folder: str) -> dict[str, object]:
    import torch.distributed.checkpoint as dcp

    model = _tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1)
    model(torch.randn(5, 4)).square().sum().backward()
    optimizer.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=folder)
    return {"state": {k: {n: t.clone() for n, t in v.items()} for k, v in optimizer.state_dict()["state"].items()}}


def test_a_size_field_set_to_an_extreme_in_a_distcp_entry_is_refused_before_torch_allocates(
    dcp_plain: Saved, tmp_path: Path
) -> None:
    """Each tensor of a .distcp file is a torch.save archive; torch's zip reader trusts its directory's sizes and
    would allocate what a damaged field claims (found by scripts/fuzz.py). The slice is checked first."""
    folder = tmp_path / "dcp"
    shutil.copytree(dcp_plain.path, folder)
    distcp = next(folder.glob("*.distcp"))
    data = bytearray(distcp.read_bytes())
    central = data.index(b"PK\x01\x02")  # the first entry's central directory record
    data[central + 20 : central + 28] = b"\xff\xff\xff\x7f" * 2  # compressed and uncompressed size
    distcp.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=r"DCP folder .* is damaged"):
        read_dcp(folder)
