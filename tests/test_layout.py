"""Recognising this toolkit's file format and the foreign layouts people commonly save."""

from __future__ import annotations

import pytest
import torch

import dist_resume as dr
from dist_resume._layout.layout import FORMAT_NAME, FORMAT_VERSION, Key, is_state_dict, split_checkpoint
from tests.models import TinyNet


@pytest.fixture
def model_sd():
    return TinyNet().state_dict()


@pytest.fixture
def opt_sd():
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 4)).sum().backward()
    opt.step()
    return opt.state_dict()


def test_toolkit_layout(model_sd, opt_sd):
    obj = {
        Key.FORMAT: FORMAT_NAME,
        Key.VERSION: FORMAT_VERSION,
        Key.MODEL: model_sd,
        Key.OPTIMIZER: opt_sd,
        Key.SCHEDULER: {"last_epoch": 3},
        Key.SCALER: {"scale": 2.0},
        Key.EXTRA: {"note": "x"},
        Key.META: {"step": 12, "epoch": 2, "world_size": 4},
    }
    parts = split_checkpoint(obj)
    assert parts.layout is dr.Layout.TOOLKIT
    assert parts.model is model_sd and parts.optimizer is opt_sd
    assert parts.scheduler == {"last_epoch": 3} and parts.scaler == {"scale": 2.0}
    assert (parts.step, parts.epoch, parts.extra) == (12, 2, {"note": "x"})
    assert parts.meta["world_size"] == 4


def test_toolkit_layout_without_model_is_an_error():
    with pytest.raises(dr.errors.NotACheckpointError, match="no model state"):
        split_checkpoint({Key.FORMAT: FORMAT_NAME, Key.META: {}})


@pytest.mark.parametrize("prefix", ["", "module.", "_orig_mod.module."])
def test_bare_state_dict(model_sd, prefix):
    sd = {prefix + k: v for k, v in model_sd.items()}
    parts = split_checkpoint(sd)
    assert parts.layout is dr.Layout.BARE
    assert parts.model is sd and parts.optimizer is None and parts.step is None


@pytest.mark.parametrize(
    "layout, model_key, opt_key, extra",
    [
        (dr.Layout.MODEL_OPTIMIZER, "model", "optimizer", {"epoch": 4, "step": 40}),
        (dr.Layout.LIGHTNING, "state_dict", "optimizer_states", {"epoch": 4, "global_step": 40}),
        (dr.Layout.STATE_DICT, "state_dict", "optimizer", {"epoch": 4, "iter": 40}),  # pytorch/examples imagenet
        (dr.Layout.MODEL_STATE_DICT, "model_state_dict", "optimizer_state_dict", {"epoch": 4, "iteration": 40}),
    ],
)
def test_foreign_layouts(model_sd, opt_sd, layout, model_key, opt_key, extra):
    opt_value = [opt_sd] if opt_key == "optimizer_states" else opt_sd  # Lightning: one entry per optimizer
    obj = {model_key: model_sd, opt_key: opt_value, "best_acc": 0.9, **extra}
    parts = split_checkpoint(obj)
    assert parts.layout is layout
    assert parts.model is model_sd and parts.optimizer is opt_sd
    assert parts.step == 40 and parts.epoch == 4
    assert parts.extra["best_acc"] == 0.9
    assert model_key not in parts.extra and opt_key not in parts.extra


def test_foreign_layout_with_scheduler_and_scaler(model_sd, opt_sd):
    obj = {
        "model_state_dict": model_sd,
        "optimizer_state_dict": opt_sd,
        "scheduler_state_dict": {"last_epoch": 1},
        "scaler_state_dict": {"scale": 8.0},
        "epoch": torch.tensor(3),
    }
    parts = split_checkpoint(obj)
    assert parts.scheduler == {"last_epoch": 1} and parts.scaler == {"scale": 8.0}
    assert parts.epoch == 3  # a tensor holding an int counts
    assert parts.extra == {"epoch": obj["epoch"]}


@pytest.mark.parametrize("bad", [True, 2.5, "7", torch.tensor([1, 2])])
def test_non_integer_counters_are_ignored(model_sd, bad):
    assert split_checkpoint({"model": model_sd, "step": bad}).step is None


def test_no_model_entry_is_an_error(opt_sd):
    with pytest.raises(dr.errors.NotACheckpointError) as info:
        split_checkpoint({"net": {"w": [1.0]}, "opt": opt_sd, "epoch": 2}, "checkpoint 'x.pt'")
    msg = str(info.value)
    assert "checkpoint 'x.pt'" in msg and "'net', 'opt', 'epoch'" in msg and "'model_state_dict'" in msg
    assert "part_keys={'model': '<key>'}" in msg


def test_parts_say_which_key_they_came_from(model_sd, opt_sd):
    parts = split_checkpoint({"model": model_sd, "optimizer": opt_sd, "epoch": 2})
    assert parts.keys == {"model": "model", "optimizer": "optimizer", "epoch": "epoch"}
    assert parts.describe_keys() == "model <- 'model', optimizer <- 'optimizer', epoch <- 'epoch'"
    toolkit = {Key.FORMAT: FORMAT_NAME, Key.MODEL: model_sd, Key.OPTIMIZER: opt_sd, Key.META: {}}
    assert split_checkpoint(toolkit).keys == {"model": "model", "optimizer": "optimizer"}
    assert split_checkpoint(model_sd).keys == {}


@pytest.mark.parametrize("obj", [[1, 2], torch.ones(2), 3, None])
def test_not_a_mapping(obj):
    with pytest.raises(dr.errors.NotACheckpointError, match="not a state dict"):
        split_checkpoint(obj)


def test_empty_dict_is_not_a_checkpoint():
    with pytest.raises(dr.errors.NotACheckpointError):
        split_checkpoint({})


def test_is_state_dict():
    assert is_state_dict({"w": torch.ones(1)})
    assert is_state_dict({"w": torch.ones(1), "layer._extra_state": {"anything": 1}})
    assert not is_state_dict({})
    assert not is_state_dict({"w": torch.ones(1), "epoch": 3})
    assert not is_state_dict({0: torch.ones(1)})
    assert not is_state_dict({"layer._extra_state": 1})  # no tensor at all


def _toolkit(model_sd, **meta):
    return {Key.FORMAT: FORMAT_NAME, Key.VERSION: FORMAT_VERSION, Key.MODEL: model_sd, Key.META: meta}


META_CASES = [
    ("step", -1, "'step' is -1, not an int from 0 to 2**63-1"),
    ("step", 10**30, "'step' is 1000000000000000000000000000000, not an int from 0"),
    ("epoch", -(10**30), "'epoch' is -1000000000000000000000000000000, not an int from 0"),
    ("epoch", 2**70, "'epoch' is 1180591620717411303424, not an int from 0"),
    ("epoch", 10**5000, "'epoch' is an int of 16610 bits, not an int from 0"),  # past repr's 4,300 digits
    ("world_size", 0, "'world_size' is 0, not an int from 1"),
    ("world_size", 2**70, "'world_size' is 1180591620717411303424, not an int from 1"),
    ("saved_at", 2**70, "'saved_at' is 1180591620717411303424, not a time in seconds"),
    ("saved_at", float("nan"), "'saved_at' is nan, not a time in seconds"),
    ("epoch", "1", "'epoch' is a str, not an int from 0"),
    ("epoch", 1.0, "'epoch' is a float, not an int from 0"),
    ("step", torch.tensor([7, 7]), "'step' is a Tensor, not an int from 0"),
    ("torch_version", 3, "'torch_version' is an int, not a str"),
]


# (ids given: an int of 5,000 digits has no str)
@pytest.mark.parametrize(("key", "value", "said"), META_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(META_CASES)])
def test_a_meta_entry_out_of_its_range_or_of_another_type_is_not_a_checkpoint(model_sd, key, value, said):
    """What save_checkpoint writes under ``meta``, in its range (docs/errors.md: an int past int64 is an error):
    the one check (_layout/meta.py) that split, the verdict and list's torch-free path all call."""
    from dist_resume._layout.meta import toolkit_meta

    with pytest.raises(dr.errors.NotACheckpointError) as info:
        split_checkpoint(_toolkit(model_sd, **{key: value}), "checkpoint 'x.pt'")
    assert said in str(info.value) and "checkpoint 'x.pt'" in str(info.value), str(info.value)
    with pytest.raises(dr.errors.NotACheckpointError):
        toolkit_meta({Key.META: {key: value}}, "x.pt")
    good = split_checkpoint(_toolkit(model_sd, step=0, epoch=2**63 - 1, world_size=1, saved_at=-1.5))
    assert (good.step, good.epoch) == (0, 2**63 - 1)


@pytest.mark.parametrize(
    ("part", "value"),
    [
        (Key.OPTIMIZER, {"state": {0: {"momentum_buffer": torch.zeros(1).expand(3)}}, "param_groups": []}),
        (Key.SCHEDULER, {"base_lrs": [torch.nested.nested_tensor([torch.ones(2)])]}),
        (Key.SCALER, {"scale": torch.ones(1).to_sparse()}),
        (Key.RNG, [{"python": (3, torch.zeros(1, dtype=torch.int64).expand(10**9), None), "torch": torch.ones(2)}]),
        (Key.EXTRA, {"mask": torch.zeros(1).expand(4, 4)}),
    ],
)
def test_a_tensor_that_is_not_dense_is_refused_by_kind_before_an_element_is_read(model_sd, part, value):
    """Sparse, nested, quantized and expanded tensors anywhere but the model (whose kinds the live model decides):
    NotACheckpointError from their shape and strides alone (an expanded view of 10**9 elements costs nothing);
    a part the resume does not restore (``wanted``) is not looked at."""
    obj = {**_toolkit(model_sd, step=1), part: value}
    with pytest.raises(dr.errors.NotACheckpointError, match=rf"\['{part}'\].*\((a|an) (nested|sparse|expanded)"):
        split_checkpoint(obj, "checkpoint 'x.pt'")
    if part != Key.EXTRA:
        with pytest.raises(dr.errors.NotACheckpointError):
            split_checkpoint(obj, wanted={"model", part})
    assert split_checkpoint(obj, wanted={"model"}).step == 1
    expanded_model = {**model_sd, "fc.bias": torch.zeros(1).expand(3)}
    assert split_checkpoint(_toolkit(expanded_model)).model is expanded_model  # the model's check says it


def test_which_tensors_overlap_is_judged_from_shape_and_strides() -> None:
    from dist_resume._core.strides import overlapping
    from dist_resume._core.tensor_kind import tensor_kind

    for t, overlaps in [
        (torch.zeros(3, 2).t(), False),
        (torch.zeros(4, 6)[:, ::2], False),
        (torch.zeros(5)[1:3], False),
        (torch.zeros(1).expand(0, 3), False),
        (torch.zeros(3).reshape(1, 3).expand(1, 3), False),  # expanded along a dimension of size 1: no two alike
        (torch.zeros(1).expand(4), True),
        (torch.zeros(3).reshape(3, 1).expand(3, 4), True),
        (torch.zeros(6).as_strided((2, 3), (1, 1)), True),  # overlapping windows, no stride of 0
    ]:
        assert overlapping(t.shape, t.stride()) is overlaps, (t.shape, t.stride())
        assert (tensor_kind(t) is not None) is overlaps
    assert tensor_kind(torch.zeros(1, device="meta").expand(5)) == "an expanded tensor, its elements sharing memory"
