"""convert between formats (.pt, .safetensors, DCP folders, foreign folders) and re-keying detected layouts.

The safetensors files are checked with the ``safetensors`` package as well as the project's own reader;
the DCP folders with ``dcp.load`` + DSD's ``set_state_dict``, as an FSDP user would load them.
"""

from __future__ import annotations

import argparse
from typing import Any

import pytest
import torch
from torch import nn

from dist_resume._convert import archive_build
from dist_resume._convert import formats as convert_formats
from dist_resume._convert.convert import ConvertFormat, KeyForm, convert_checkpoint
from dist_resume._foreign import safetensors_read as safetensors_io
from dist_resume._foreign.safetensors_read import read_safetensors
from dist_resume.cli import main
from dist_resume.errors import KeyMismatchError, NotACheckpointError, UsageError
from tests.models import TinyNet, make_batches, train_steps

safetensors_torch = pytest.importorskip("safetensors.torch")


def _ddp(sd: dict[str, Any]) -> dict[str, Any]:
    return {f"module.{k}": v for k, v in sd.items()}


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b) or sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


@pytest.fixture
def no_tensor_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every way this package could deserialize tensor bytes fails: torch.load, frombuffer, from_file, the reader."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("tensor bytes were deserialized")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(torch, "frombuffer", refuse)
    monkeypatch.setattr(torch.UntypedStorage, "from_file", refuse)
    monkeypatch.setattr(safetensors_io, "read_safetensors", refuse)


def _weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    big = torch.arange(40, dtype=torch.float32)
    return {
        "fc.weight": torch.randn(3, 4),
        "fc.bias": torch.randn(3),
        "half": torch.randn(5, 2).to(torch.bfloat16),
        "count": torch.tensor(7, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "u16": torch.arange(6).reshape(2, 3).to(torch.uint16),
        "view": big[5:17].view(3, 4),  # a contiguous view into a larger storage (storage_offset 5)
        "empty": torch.empty(0, 3),
    }


# --- .pt -> .safetensors -------------------------------------------------------------------------


def test_pt_to_safetensors_copies_the_weights_exactly_with_plain_keys(tmp_path, no_tensor_loading, monkeypatch):
    sd = _weights()
    src, dst = tmp_path / "ddp.pt", tmp_path / "model.safetensors"
    torch.serialization.save({"model": _ddp(sd), "epoch": 3, "step": 12}, src)
    result = convert_checkpoint(src, dst, format="safetensors")
    assert result.format is ConvertFormat.SAFETENSORS and result.prefix_before == "module."
    assert result.prefix_after == "none" and result.model_keys == len(sd)
    monkeypatch.undo()  # the conversion is done: now load the output
    _assert_equal(safetensors_torch.load_file(str(dst)), {k: v.contiguous() for k, v in sd.items()})
    _, _, metadata = safetensors_io.read_safetensors_header(dst)
    assert metadata == {"format": "pt", "step": "12", "epoch": "3"}


def test_pt_to_safetensors_reads_back_with_the_project_reader_and_to_ddp_keeps_module(tmp_path):
    sd = _weights()
    src, dst = tmp_path / "single.pt", tmp_path / "model.safetensors"
    torch.save(sd, src)
    assert main(["convert", str(src), str(dst), "--format", "safetensors", "--to", "ddp", "-q"]) == 0
    ours, _ = read_safetensors(dst, mmap=False)
    _assert_equal(ours, _ddp(sd))
    _assert_equal(safetensors_torch.load_file(str(dst)), _ddp(sd))
    with open(dst, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
    assert (8 + n) % 8 == 0  # the data starts 8-byte aligned


def test_pt_to_safetensors_refuses_a_non_contiguous_view_by_name(tmp_path):
    src = tmp_path / "t.pt"
    torch.save({"w": torch.randn(3, 4).t(), "b": torch.zeros(2)}, src)
    with pytest.raises(NotACheckpointError, match=r"'w' is a non-contiguous view.*contiguous\(\)"):
        convert_checkpoint(src, tmp_path / "o.safetensors", format="safetensors")
    assert not (tmp_path / "o.safetensors").exists()


# --- .safetensors -> .pt -------------------------------------------------------------------------


def test_safetensors_to_pt_loads_with_weights_only_and_keeps_every_byte(tmp_path, no_tensor_loading):
    sd = {k: v.contiguous() for k, v in _weights().items()}
    src, dst = tmp_path / "model.safetensors", tmp_path / "model.pt"
    safetensors_torch.save_file(sd, str(src), metadata={"step": "40", "epoch": "2"})
    result = convert_checkpoint(src, dst, to="ddp")
    assert result.prefix_after == "module." and result.renamed_keys == len(sd)
    assert result.layout.value == "safetensors"  # the source's layout, not "bare state dict"
    monkeypatch_free_load = torch.serialization.load  # torch.load is patched; the module function is not
    obj = monkeypatch_free_load(dst, weights_only=True)
    assert obj["format"] == "dist_resume" and obj["meta"]["step"] == 40 and obj["meta"]["epoch"] == 2
    _assert_equal(obj["model"], _ddp(sd))


def test_safetensors_round_trip_through_pt_is_exact_and_crc_sound(tmp_path):
    import zipfile

    sd = {k: v.contiguous() for k, v in _weights().items()}
    first, pt, back = tmp_path / "a.safetensors", tmp_path / "a.pt", tmp_path / "b.safetensors"
    safetensors_torch.save_file(sd, str(first))
    assert main(["convert", str(first), str(pt), "--format", "pt", "-q"]) == 0
    with zipfile.ZipFile(pt) as zf:
        assert zf.testzip() is None  # every record's CRC32 matches its bytes
    assert main(["convert", str(pt), str(back), "--format", "safetensors", "-q"]) == 0
    _assert_equal(safetensors_torch.load_file(str(back)), sd)


def test_safetensors_to_pt_memory_does_not_hold_the_tensors(tmp_path, monkeypatch):
    """The CRC pass reads through the mapped source; nothing else touches the bytes in user space."""
    src = tmp_path / "m.safetensors"
    safetensors_torch.save_file({"w": torch.randn(64, 64)}, str(src))
    raw = archive_build.read_safetensors_meta(src)
    assert all(t.is_meta for t in raw.tensors.values())
    assert raw.ranges["0"][1] == 64 * 64 * 4


# --- .pt -> DCP ----------------------------------------------------------------------------------


def _trained(named: bool = True) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = TinyNet()
    params = model.named_parameters() if named else model.parameters()
    opt = torch.optim.Adam(params, lr=0.01)
    train_steps(model, opt, make_batches(2))
    return model, opt


def test_pt_to_dcp_loads_with_dcp_load_and_set_state_dict(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _trained()
    osd = opt.state_dict()
    for g in osd["param_groups"]:
        g["param_names"] = [f"module.{n}" for n in g["param_names"]]
    src, dst = tmp_path / "ddp.pt", tmp_path / "dcp"
    torch.save({"model": _ddp(model.state_dict()), "optimizer": osd, "epoch": 4}, src)
    assert main(["convert", str(src), str(dst), "--format", "dcp", "-q"]) == 0

    fresh = TinyNet(seed=1)
    fresh_opt = torch.optim.Adam(fresh.named_parameters(), lr=0.01)
    msd, fosd = get_state_dict(fresh, fresh_opt)
    state: dict[str, Any] = {"model": msd, "optim": fosd}
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        dcp.load(state, checkpoint_id=str(dst), no_dist=True)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _assert_equal(fresh.state_dict(), model.state_dict())
    for p_new, p_old in zip(fresh.parameters(), model.parameters()):
        new, old = fresh_opt.state[p_new], opt.state[p_old]
        assert torch.equal(new["exp_avg"], old["exp_avg"]) and torch.equal(new["exp_avg_sq"], old["exp_avg_sq"])


def test_dcp_folder_converts_back_to_a_dist_resume_pt(tmp_path):
    model, opt = _trained()
    src, folder, back = tmp_path / "a.pt", tmp_path / "dcp", tmp_path / "back.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, src)
    convert_checkpoint(src, folder, format=ConvertFormat.DCP)
    result = convert_checkpoint(folder, back, to=KeyForm.DDP)
    assert result.prefix_after == "module."
    obj = torch.load(back, weights_only=True)
    assert obj["format"] == "dist_resume"
    _assert_equal(obj["model"], _ddp(model.state_dict()))
    assert obj["optimizer"]["param_groups"][0]["param_names"][0] == "module.fc.weight"
    assert torch.equal(obj["optimizer"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_pt_to_dcp_without_param_names_and_with_buffers_is_refused(tmp_path):
    model, opt = _trained(named=False)
    src = tmp_path / "a.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, src)
    with pytest.raises(UsageError, match="carry no names") as err:
        convert_checkpoint(src, tmp_path / "dcp", format="dcp")
    assert "named_parameters" in err.value.hint
    assert not (tmp_path / "dcp").exists()


def _layerwise(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False))  # two same-shaped weights
    opt = torch.optim.AdamW([{"params": [model[1].weight], "lr": 1e-2}, {"params": [model[0].weight], "lr": 5e-3}])
    model(torch.randn(3, 8)).square().sum().backward()
    opt.step()
    return model, opt


def test_pt_to_dcp_never_pairs_unnamed_state_by_position_across_groups(tmp_path):
    # layer-wise learning rates list the last layer first: pairing by model order would swap the
    # two layers' Adam moments silently (the shapes are equal), so the export is refused
    model, opt = _layerwise(0)
    src = tmp_path / "lw.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, src)
    with pytest.raises(UsageError, match="2 group") as err:
        convert_checkpoint(src, tmp_path / "dcp", format="dcp")
    assert "named_parameters" in err.value.hint
    assert not (tmp_path / "dcp").exists()


def _one_group(seed: int) -> tuple[nn.Sequential, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(3, 8)).square().sum().backward()
    opt.step()
    return model, opt


def test_pt_to_dcp_never_pairs_by_position_a_model_read_from_a_foreign_reader(tmp_path):
    # a model converted from safetensors / an HF folder has the file's key order (sorted), not the module's
    model, opt = _one_group(0)
    src = tmp_path / "a.pt"
    meta = {"source_layout": "hf-trainer"}
    torch.save(
        {
            "format": "dist_resume",
            "format_version": 1,
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "meta": meta,
        },
        src,
    )
    with pytest.raises(UsageError, match="carry no names"):
        convert_checkpoint(src, tmp_path / "dcp", format="dcp")


def test_pt_to_dcp_pairs_one_unnamed_group_by_position_when_shapes_fit(tmp_path):
    import torch.distributed.checkpoint as dcp

    model, opt = _one_group(0)
    src, dst = tmp_path / "a.pt", tmp_path / "dcp"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, src)
    convert_checkpoint(src, dst, format="dcp")
    state = {"optim.state.1.weight.exp_avg": torch.zeros(2, 4)}
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        dcp.load(state, checkpoint_id=str(dst), no_dist=True)
    assert torch.equal(state["optim.state.1.weight.exp_avg"], opt.state[model.get_parameter("1.weight")]["exp_avg"])


# --- detected layouts, --part, Namespace -----------------------------------------------------------


def test_tutorial_snapshot_to_ddp_rekeys_only_model_state(tmp_path, no_tensor_loading):
    model, opt = _trained()
    src, dst = tmp_path / "snapshot.pt", tmp_path / "ddp.pt"
    stats = {"loss": [1.5, 1.25], "best": 1.25}  # anything else is left alone
    snapshot = {"MODEL_STATE": model.state_dict(), "EPOCHS_RUN": 3, "OPT": opt.state_dict(), "stats": stats}
    torch.serialization.save(snapshot, src)
    result = convert_checkpoint(src, dst, to="ddp")
    assert result.layout.value == "detected" and result.param_names == len(list(model.parameters()))
    obj = torch.serialization.load(dst, weights_only=True)
    assert list(obj) == ["MODEL_STATE", "EPOCHS_RUN", "OPT", "stats"] and obj["EPOCHS_RUN"] == 3
    _assert_equal(obj["MODEL_STATE"], _ddp(model.state_dict()))
    assert obj["stats"] == stats
    assert obj["OPT"]["param_groups"][0]["param_names"][0] == "module.fc.weight"


def test_nested_model_entry_is_rekeyed_in_place(tmp_path):
    sd = TinyNet().state_dict()
    src, dst = tmp_path / "n.pt", tmp_path / "o.pt"
    torch.save({"state": {"net": _ddp(sd), "it": 5}}, src)
    assert main(["convert", str(src), str(dst), "--to", "single", "-q"]) == 0
    obj = torch.load(dst, weights_only=True)
    assert obj["state"]["it"] == 5
    _assert_equal(obj["state"]["net"], sd)


def test_part_chooses_between_two_candidate_models(tmp_path, capsys):
    a, b = TinyNet(seed=0).state_dict(), TinyNet(seed=1).state_dict()
    src, dst = tmp_path / "two.pt", tmp_path / "o.pt"
    torch.save({"student": a, "teacher": b}, src)
    assert main(["convert", str(src), str(dst), "--to", "ddp"]) == 2
    assert "'student'" in capsys.readouterr().err
    assert main(["convert", str(src), str(dst), "--to", "ddp", "--part", "model=teacher", "-q"]) == 0
    obj = torch.load(dst, weights_only=True)
    _assert_equal(obj["teacher"], _ddp(b))
    _assert_equal(obj["student"], a)
    assert main(["convert", str(src), str(dst), "--to", "ddp", "--part", "model", "--force"]) == 2
    assert "PART=KEY" in capsys.readouterr().err


def test_namespace_args_become_a_plain_dict_that_loads_weights_only(tmp_path):
    # what torchvision's references/classification/train.py saves (reproduced: torchvision is not installed)
    model, opt = _trained()
    args = argparse.Namespace(lr=0.1, epochs=90, model="resnet18", nested=argparse.Namespace(x=1))
    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3, "args": args}
    src, dst, st = tmp_path / "tv.pt", tmp_path / "o.pt", tmp_path / "o.safetensors"
    torch.save(ckpt, src)
    with pytest.raises(Exception, match="Namespace"):
        torch.load(src, weights_only=True)
    assert main(["convert", str(src), str(dst), "--format", "pt", "-q"]) == 0
    obj = torch.load(dst, weights_only=True)
    assert obj["args"] == {"lr": 0.1, "epochs": 90, "model": "resnet18", "nested": {"x": 1}}
    _assert_equal(obj["model"], model.state_dict())
    assert main(["convert", str(src), str(st), "--format", "safetensors", "-q"]) == 0
    _assert_equal(safetensors_torch.load_file(str(st)), model.state_dict())


def test_plain_namespaces_keeps_identity_of_untouched_containers():
    sd = {"w": torch.ones(1)}
    obj = {"model": sd, "args": argparse.Namespace(a=[1, argparse.Namespace(b=2)]), "t": (1, 2)}
    out = convert_formats.plain_namespaces(obj)
    assert out is obj and out["model"] is sd and out["args"] == {"a": [1, {"b": 2}]} and out["t"] == (1, 2)


# --- bad inputs ----------------------------------------------------------------------------------


def test_unsupported_directions_and_values_are_usage_errors(tmp_path, capsys):
    st = tmp_path / "m.safetensors"
    safetensors_torch.save_file({"w": torch.ones(2)}, str(st))
    with pytest.raises(UsageError, match="safetensors file to dcp is not supported") as err:
        convert_checkpoint(st, tmp_path / "dcp", format="dcp")
    assert "--format pt" in err.value.hint
    with pytest.raises(UsageError, match="format='onnx' is not one of"):
        convert_checkpoint(st, tmp_path / "x.pt", format="onnx")
    with pytest.raises(UsageError, match="to='fsdp'"):
        convert_checkpoint(st, tmp_path / "x.pt", to="fsdp")
    assert main(["convert", str(st), str(tmp_path / "o.pt")]) == 2
    assert "needs --to, --format or both" in capsys.readouterr().err
    (tmp_path / "exists.pt").write_bytes(b"x")
    with pytest.raises(UsageError, match="already exists"):
        convert_checkpoint(st, tmp_path / "exists.pt", format="pt")


def test_a_dcp_export_refuses_to_ddp_and_a_file_as_dst(tmp_path):
    src = tmp_path / "a.pt"
    torch.save({"w": torch.ones(2)}, src)
    with pytest.raises(UsageError, match="--to ddp does not apply to a DCP folder"):
        convert_checkpoint(src, tmp_path / "dcp", to="ddp", format="dcp")
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(UsageError, match="is a file"):
        convert_checkpoint(src, tmp_path / "file", format="dcp", force=True)


def test_damaged_safetensors_and_colliding_keys_are_distresume_errors(tmp_path):
    st = tmp_path / "bad.safetensors"
    st.write_bytes((100).to_bytes(8, "little") + b"{" + b" " * 20)
    with pytest.raises(Exception) as err:
        convert_checkpoint(st, tmp_path / "o.pt", format="pt")
    assert type(err.value).__module__.startswith("dist_resume") or "DistResumeError" in repr(type(err.value).__mro__)
    src = tmp_path / "mixed.pt"
    torch.save({"fc.weight": torch.ones(1), "module.fc.weight": torch.zeros(1)}, src)
    with pytest.raises(KeyMismatchError, match="collide"):
        convert_checkpoint(src, tmp_path / "o.safetensors", format="safetensors")
