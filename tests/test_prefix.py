"""Prefixes: strip/add, canonical keys, unwrapping, and re-keying between every wrapping."""

from __future__ import annotations

import itertools
from collections import OrderedDict

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import dist_resume as dr
from tests.helpers import metadata_of
from tests.models import WRAPPERS, TinyNet, compile_module, single_rank_group, wrap

# ---------------------------------------------------------------- strip_prefix / add_prefix


def test_strip_prefix_touches_only_a_leading_prefix():
    w, b = torch.ones(2, 2), torch.zeros(2)
    sd = OrderedDict([("module.submodule.weight", w), ("module.fc.module.bias", b), ("submodule.bias", b)])
    out = dr.strip_prefix(sd)
    assert list(out) == ["submodule.weight", "fc.module.bias", "submodule.bias"]
    # the naive fix people write corrupts exactly this key
    assert "module.submodule.weight".replace("module.", "") == "subweight"
    assert "subweight" not in out
    assert list(sd) == ["module.submodule.weight", "module.fc.module.bias", "submodule.bias"]  # input untouched


def test_strip_prefix_of_a_real_wrapped_state_dict_is_the_plain_one_zero_copy():
    net = TinyNet()
    wrapped_sd = nn.DataParallel(net).state_dict()
    plain_sd = net.state_dict()
    out = dr.strip_prefix(wrapped_sd)
    assert list(out) == list(plain_sd)
    for key, value in out.items():
        assert value is wrapped_sd["module." + key]
        assert value.data_ptr() == plain_sd[key].data_ptr()  # the same storage: nothing was copied
    # _metadata re-keyed consistently, BatchNorm's version 2 kept under its new name
    assert dict(metadata_of(out)) == dict(metadata_of(plain_sd))
    assert metadata_of(out)["bn"]["version"] == 2
    # and it really loads
    fresh = TinyNet(seed=1)
    fresh.load_state_dict(out, strict=True)
    assert torch.equal(fresh.fc.weight, net.fc.weight)


def test_add_prefix_of_a_plain_state_dict_is_the_wrapped_one_zero_copy():
    net = TinyNet()
    plain_sd = net.state_dict()
    wrapped_sd = nn.DataParallel(net).state_dict()
    out = dr.add_prefix(plain_sd)
    assert list(out) == list(wrapped_sd)
    assert all(out[k] is plain_sd[k[len("module.") :]] for k in out)
    assert dict(metadata_of(out)) == dict(metadata_of(wrapped_sd))
    assert metadata_of(out)["module.bn"]["version"] == 2
    dp = nn.DataParallel(TinyNet(seed=1))
    dp.load_state_dict(out, strict=True)
    assert torch.equal(dp.module.head.bias, net.head.bias)


def test_add_then_strip_compile_prefix_round_trips_with_metadata():
    sd = TinyNet().state_dict()
    back = dr.strip_prefix(dr.add_prefix(sd, "_orig_mod."), "_orig_mod.")
    assert list(back) == list(sd)
    assert dict(metadata_of(back)) == dict(metadata_of(sd))
    assert list(dr.add_prefix(sd, "_orig_mod.")) == list(compile_module(TinyNet()).state_dict())


def test_strip_prefix_works_on_plain_dicts_without_metadata():
    out = dr.strip_prefix({"module.w": torch.ones(1)})
    assert list(out) == ["w"] and not hasattr(out, "_metadata")
    out = dr.add_prefix({"w": torch.ones(1)})
    assert list(out) == ["module.w"] and not hasattr(out, "_metadata")


def test_strip_prefix_refuses_to_collapse_two_keys_into_one():
    with pytest.raises(dr.errors.KeyMismatchError, match="collide"):
        dr.strip_prefix({"module.w": torch.ones(1), "w": torch.zeros(1)})


@pytest.mark.parametrize("bad", ["module", ".module.", "a..b.", "", 3])
def test_prefix_must_be_dotted(bad):
    with pytest.raises(ValueError, match="prefix"):
        dr.strip_prefix({"module.w": torch.ones(1)}, bad)
    with pytest.raises(ValueError, match="prefix"):
        dr.add_prefix({"w": torch.ones(1)}, bad)


# ---------------------------------------------------------------- canonical_key


@pytest.mark.parametrize(
    "key, expected",
    [
        ("fc.weight", "fc.weight"),
        ("module.fc.weight", "fc.weight"),
        ("module.module.fc.weight", "fc.weight"),
        ("_orig_mod.fc.weight", "fc.weight"),
        ("_orig_mod.module.fc.weight", "fc.weight"),
        ("module._orig_mod.fc.weight", "fc.weight"),
        ("_orig_mod.module.net._orig_mod.fc.weight", "net.fc.weight"),
        ("module.submodule.weight", "submodule.weight"),
        ("submodule.weight", "submodule.weight"),
        ("net.module.weight", "net.module.weight"),  # an inner child named "module" is the user's
        ("module", "module"),  # a parameter literally named "module" keeps its name
    ],
)
def test_canonical_key(key, expected):
    assert dr.canonical_key(key) == expected


# ---------------------------------------------------------------- unwrap_model


def test_unwrap_model_under_dataparallel_and_compile_nesting():
    net = TinyNet()
    assert dr.unwrap_model(net) is net
    for kind in WRAPPERS:
        assert dr.unwrap_model(wrap(net, kind)) is net, kind
    deep = compile_module(nn.DataParallel(compile_module(nn.DataParallel(net))))
    assert dr.unwrap_model(deep) is net


def test_unwrap_model_and_adapt_under_real_ddp(tmp_path):
    src = TinyNet(seed=0)
    with single_rank_group(tmp_path):
        ddp = DDP(TinyNet(seed=1))
        inner = ddp.module
        cases: dict[str, tuple[nn.Module, str]] = {
            "ddp": (ddp, "module."),
            "ddp_compile": (DDP(compile_module(TinyNet(seed=2))), "module._orig_mod."),
            "compile_ddp": (compile_module(ddp), "_orig_mod.module."),
            "dp_ddp": (nn.DataParallel(ddp), "module.module."),
        }
        assert dr.unwrap_model(ddp) is inner
        assert dr.unwrap_model(cases["compile_ddp"][0]) is inner
        assert dr.unwrap_model(cases["dp_ddp"][0]) is inner
        assert isinstance(dr.unwrap_model(cases["ddp_compile"][0]), TinyNet)
        for name, (model, prefix) in cases.items():
            assert all(k.startswith(prefix) for k in model.state_dict()), name
            # checkpoint from a plain model into every DDP form, and each DDP form back to plain
            adapted = dr.adapt_state_dict(src.state_dict(), model)
            assert list(adapted) == list(model.state_dict()), name
            model.load_state_dict(adapted, strict=True)
            back = dr.adapt_state_dict(model.state_dict(), TinyNet(seed=3))
            assert list(back) == list(src.state_dict()), name
            for k, v in src.state_dict().items():
                assert torch.equal(back[k], v), (name, k)


# ---------------------------------------------------------------- adapt_state_dict


@pytest.mark.parametrize("src_kind, dst_kind", list(itertools.product(WRAPPERS, repeat=2)))
def test_adapt_state_dict_every_wrapping_both_directions(src_kind, dst_kind):
    src_net, dst_net = TinyNet(seed=0), TinyNet(seed=1)
    assert src_net.bn.running_mean is not None and src_net.bn.num_batches_tracked is not None
    src_net.bn.running_mean.add_(1.5)
    src_net.bn.num_batches_tracked.fill_(7)
    src, dst = wrap(src_net, src_kind), wrap(dst_net, dst_kind)
    saved = src.state_dict()

    adapted = dr.adapt_state_dict(saved, dst)

    target_sd = dst.state_dict()
    assert list(adapted) == list(target_sd)  # exactly the target's key form and order
    prefix = WRAPPERS[dst_kind][1]
    assert all(k.startswith(prefix) for k in adapted)
    for key, value in adapted.items():  # zero-copy: the checkpoint's own tensors
        assert value is saved[WRAPPERS[src_kind][1] + key[len(prefix) :]]
    # metadata follows the keys: BatchNorm's version survives under the target's name
    assert metadata_of(adapted)[prefix + "bn"]["version"] == 2
    assert set(metadata_of(adapted)) <= set(metadata_of(target_sd))

    dst.load_state_dict(adapted, strict=True)
    for key, value in src_net.state_dict().items():
        assert torch.equal(dst_net.state_dict()[key], value), key
    assert dst_net.bn.num_batches_tracked is not None and dst_net.bn.num_batches_tracked.item() == 7


def test_adapt_state_dict_handles_a_model_with_a_child_named_module():
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(2, 2)
            self.submodule = nn.Linear(2, 2)

    plain = Holder()
    for src_kind, dst_kind in itertools.product(["plain", "dp", "dp_dp", "compile_dp"], repeat=2):
        saved = wrap(plain, src_kind).state_dict()
        dst = wrap(Holder(), dst_kind)
        adapted = dr.adapt_state_dict(saved, dst)
        assert list(adapted) == list(dst.state_dict()), (src_kind, dst_kind)
        dst.load_state_dict(adapted, strict=True)
        inner = dr.unwrap_model(dst)
        assert isinstance(inner, Holder)
        assert torch.equal(inner.module.weight, plain.module.weight)


def test_adapt_state_dict_reports_missing_unexpected_and_shapes_with_counts():
    saved = TinyNet(width=5).state_dict()  # every layer but the input is a different shape
    saved["extra.weight"] = torch.zeros(1)
    del saved["head.bias"]
    model = nn.DataParallel(TinyNet(width=3))
    with pytest.raises(dr.errors.KeyMismatchError) as info:
        dr.adapt_state_dict(saved, model)
    err = info.value
    msg = str(err)
    assert err.missing == ["module.head.bias"]
    assert err.unexpected == ["extra.weight"]
    assert len(err.mismatched) == 9 and "module.fc.weight: checkpoint (5, 4), model (3, 4)" in err.mismatched
    assert "missing from checkpoint (1: 'module.head.bias')" in msg
    assert "unexpected in checkpoint (1: 'extra.weight')" in msg
    assert "shape mismatch (9: " in msg and "and 4 more" in msg  # first five shown, then the count
    assert "TinyNet" in msg and "in model: module." in msg


def test_adapt_state_dict_lists_first_few_and_counts_long_key_lists():
    saved = {f"layer{i}.weight": torch.zeros(1) for i in range(12)}
    with pytest.raises(dr.errors.KeyMismatchError) as info:
        dr.adapt_state_dict(saved, nn.Linear(2, 2))
    msg = str(info.value)
    assert "unexpected in checkpoint (12: 'layer0.weight'" in msg and "and 7 more" in msg
    assert "missing from checkpoint (2: 'weight', 'bias')" in msg
    assert "strict=False" in msg  # only names/keys differ: the hint offers strict=False
    assert len(info.value.unexpected) == 12


def test_adapt_state_dict_strict_false_drops_unexpected_allows_missing():
    saved = dr.add_prefix(TinyNet().state_dict())
    del saved["module.head.weight"]
    saved["module.old_layer.weight"] = torch.zeros(3)
    net = TinyNet(seed=1)
    model = compile_module(net)  # its parameters are net's
    adapted = dr.adapt_state_dict(saved, model, strict=False)
    assert "_orig_mod.head.weight" not in adapted
    assert not any("old_layer" in k for k in adapted)
    assert len(adapted) == len(model.state_dict()) - 1
    before = net.head.weight.detach().clone()
    model.load_state_dict(adapted, strict=False)
    assert torch.equal(net.head.weight, before)
    assert torch.equal(net.fc.weight, saved["module.fc.weight"])


def test_adapt_state_dict_shape_mismatch_raises_even_when_not_strict():
    saved = TinyNet(width=5).state_dict()
    with pytest.raises(dr.errors.KeyMismatchError, match="shape mismatch") as info:
        dr.adapt_state_dict(saved, TinyNet(width=3), strict=False)
    assert "strict=False" not in str(info.value).split("what to do")[1]  # would not help


def test_adapt_state_dict_nothing_fits():
    with pytest.raises(dr.errors.KeyMismatchError) as info:
        dr.adapt_state_dict(nn.Linear(3, 3).state_dict(), TinyNet())
    assert info.value.unexpected == ["weight", "bias"]
    assert len(info.value.missing) == len(TinyNet().state_dict())


def test_adapt_state_dict_refuses_two_checkpoint_keys_for_one_entry():
    sd = {"weight": torch.zeros(2, 2), "_orig_mod.weight": torch.ones(2, 2), "bias": torch.zeros(2)}
    with pytest.raises(dr.errors.KeyMismatchError, match="ambiguous") as info:
        dr.adapt_state_dict(sd, nn.Linear(2, 2))
    assert "'weight' and '_orig_mod.weight' -> 'weight'" in str(info.value)
    assert info.value.unexpected == ["_orig_mod.weight"]


def test_adapt_state_dict_with_a_compiled_submodule():
    class Outer(nn.Module):
        def __init__(self, compiled: bool) -> None:
            super().__init__()
            torch.manual_seed(int(compiled))
            block = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
            self.block = compile_module(block) if compiled else block
            self.head = nn.Linear(2, 1)

    for src_compiled, dst_compiled, dst_wrap in itertools.product([False, True], [False, True], ["plain", "dp"]):
        src, dst = Outer(src_compiled), wrap(Outer(dst_compiled), dst_wrap)
        adapted = dr.adapt_state_dict(src.state_dict(), dst)
        assert list(adapted) == list(dst.state_dict())
        dst.load_state_dict(adapted, strict=True)
        inner = dr.unwrap_model(dst)
        assert torch.equal(
            inner.get_parameter("block.0.weight" if not dst_compiled else "block._orig_mod.0.weight"),
            src.get_parameter("block.0.weight" if not src_compiled else "block._orig_mod.0.weight"),
        )
    assert dr.canonical_key("block._orig_mod.0.weight") == "block.0.weight"
