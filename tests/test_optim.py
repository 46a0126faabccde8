"""optimizer_to across torch.optim, and matching saved optimizer state to parameters (by name and shape).

The meta device stands in for "another device" here (a moved tensor changes device, keeps dtype and shape); the
real moves onto an accelerator (sim devices in every run, CUDA in the multi-GPU job) are in
test_devices_accelerator.py.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import dist_resume as dr
from dist_resume._state.optim.keys import state_coverage
from dist_resume._state.optim.prepare import canonical_optimizer_state, prepare_optimizer_state
from tests.models import TwinNet, TwinNetReordered, assert_same, make_batches, train_steps

META = torch.device("meta")
CPU = torch.device("cpu")

# name -> (class, kwargs, step lives on the parameter's device)
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=0.1), False),
    "sgd_momentum": (torch.optim.SGD, dict(lr=0.1, momentum=0.9), False),
    "sgd_nesterov_foreach": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, foreach=True), False),
    "adam": (torch.optim.Adam, dict(lr=1e-2), False),
    "adam_amsgrad": (torch.optim.Adam, dict(lr=1e-2, amsgrad=True), False),
    "adamw_foreach": (torch.optim.AdamW, dict(lr=1e-2, foreach=True), False),
    "adamw_loop": (torch.optim.AdamW, dict(lr=1e-2, foreach=False), False),
    "adamw_fused": (torch.optim.AdamW, dict(lr=1e-2, fused=True), True),  # fused runs on CPU in torch 2.13
    "adam_fused": (torch.optim.Adam, dict(lr=1e-2, fused=True), True),
    "rmsprop": (torch.optim.RMSprop, dict(lr=1e-2, momentum=0.9, centered=True), False),
    "adagrad": (torch.optim.Adagrad, dict(lr=1e-2), False),
    "adagrad_fused": (torch.optim.Adagrad, dict(lr=1e-2, fused=True), True),
    "adamax": (torch.optim.Adamax, dict(lr=1e-2), False),
    "nadam": (torch.optim.NAdam, dict(lr=1e-2), False),
    "radam": (torch.optim.RAdam, dict(lr=1e-2), False),
    "asgd": (torch.optim.ASGD, dict(lr=1e-2), False),
    "rprop": (torch.optim.Rprop, dict(lr=1e-2), False),
    "adadelta": (torch.optim.Adadelta, dict(lr=1.0), False),
}


def _trained(name: str, dtype: torch.dtype = torch.float32):
    cls, kwargs, _ = OPTIMIZERS[name]
    model = TwinNet().to(dtype)
    opt = cls(model.parameters(), **kwargs)
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(2, 3, dtype=dtype)).square().sum().backward()
        opt.step()
    return model, opt


def _state_tensors(opt):
    for group in opt.param_groups:
        for p in group["params"]:
            for key, value in opt.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    yield p, group, key, value


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_to_in_place_copies_nothing(name):
    _, opt = _trained(name)
    before = {(id(p), k): v for p, _, k, v in _state_tensors(opt)}
    if name == "sgd":
        assert not before  # momentum=0 keeps no state: immune to the device problem
    else:
        assert before
    assert dr.optimizer_to(opt) is opt
    assert dr.optimizer_to(opt, "cpu") is opt
    after = {(id(p), k): v for p, _, k, v in _state_tensors(opt)}
    assert after.keys() == before.keys()
    for key, value in after.items():
        assert value is before[key], key  # the same tensor objects: nothing copied


@pytest.mark.parametrize("name", [n for n in OPTIMIZERS if n != "sgd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_optimizer_to_device_follows_torchs_step_policy(name, dtype):
    if dtype == torch.float64 and "fused" in name:
        pytest.skip("fused CPU kernels in this torch take float32/16 only")
    _, opt = _trained(name, dtype)
    step_on_device = OPTIMIZERS[name][2]
    before = {(id(p), k): (v.dtype, v.shape, v.clone()) for p, _, k, v in _state_tensors(opt)}
    non_tensor = {
        id(p): {k: v for k, v in opt.state[p].items() if not isinstance(v, torch.Tensor)}
        for g in opt.param_groups
        for p in g["params"]
    }

    dr.optimizer_to(opt, META)

    seen_step = False
    for p, _, key, value in _state_tensors(opt):
        dtype_before, shape_before, _ = before[(id(p), key)]
        assert value.dtype == dtype_before and value.shape == shape_before, key  # dtypes never change
        if key == "step":
            seen_step = True
            assert value.device == (META if step_on_device else CPU), (key, value.device)
        else:
            assert value.device == META, key
    assert seen_step or name.startswith("sgd")
    for g in opt.param_groups:
        for p in g["params"]:
            assert {k: v for k, v in opt.state[p].items() if not isinstance(v, torch.Tensor)} == non_tensor[id(p)]


@pytest.mark.parametrize("name", [n for n in OPTIMIZERS if n != "sgd"])
def test_optimizer_to_moves_state_onto_each_parameters_device(name):
    """The resume bug: state loaded while the params were elsewhere; optimizer_to() follows the params."""
    cls, kwargs, step_on_device = OPTIMIZERS[name]
    _, cpu_opt = _trained(name)
    meta_model = TwinNet().to(META)
    opt = cls(meta_model.parameters(), **kwargs)
    for p_meta, p_cpu in zip(meta_model.parameters(), cpu_opt.param_groups[0]["params"]):
        opt.state[p_meta] = copy.deepcopy(cpu_opt.state[p_cpu])  # state on CPU, params on "the GPU"
    assert any(v.device == CPU for _, _, k, v in _state_tensors(opt) if k != "step")

    dr.optimizer_to(opt)

    for p, _, key, value in _state_tensors(opt):
        if key == "step" and not step_on_device:
            assert value.device == CPU
        else:
            assert value.device == p.device == META, key
    assert dr.tools.device_report(meta_model, opt) == []


def test_capturable_group_puts_step_on_the_device():
    # capturable Adam cannot step on a CPU-only host; its state is set up as torch's load_state_dict would
    model = TwinNet()
    opt = torch.optim.Adam(model.parameters(), capturable=True)
    for p in model.parameters():
        opt.state[p] = {"step": torch.tensor(3.0), "exp_avg": torch.ones_like(p), "exp_avg_sq": torch.ones_like(p)}
    dr.optimizer_to(opt, META)
    for _, _, key, value in _state_tensors(opt):
        assert value.device == META, key
    assert all(v.dtype == torch.float32 for _, _, k, v in _state_tensors(opt) if k == "step")


def test_optimizer_to_mixed_groups_and_params_without_state():
    model = TwinNet()
    groups: list[dict[str, Any]] = [{"params": model.a.parameters()}, {"params": model.b.parameters(), "lr": 0.5}]
    opt = torch.optim.AdamW(groups, fused=False)
    model.a.weight.grad = torch.ones_like(model.a.weight)  # only one parameter gets state
    opt.step()
    assert len(opt.state) == 1
    dr.optimizer_to(opt, META)
    assert len(opt.state) == 1  # no state is invented for parameters that have none
    assert opt.state[model.a.weight]["exp_avg"].device == META


# ---------------------------------------------------------------- matching saved state to parameters


def _adam_checkpoint(model_cls=TwinNet, named=False, wrapper=None):
    model = model_cls(seed=5)
    wrapped = wrapper(model) if wrapper else model
    params = wrapped.named_parameters() if named else wrapped.parameters()
    opt = torch.optim.Adam(params, lr=1e-2)
    # train through the unwrapped model: calling a compiled one would compile (slow), and changes nothing here
    train_steps(model, opt, [(torch.randn(4, 3), torch.randn(4, 3)) for _ in range(2)])
    return model, wrapped, opt


def test_torch_alone_pairs_state_by_position_and_never_checks_shapes():
    """FACTS #1, the behaviour the toolkit guards against."""
    src = nn.Linear(3, 3, bias=False)
    opt = torch.optim.SGD(src.parameters(), lr=0.1, momentum=0.9)
    src(torch.ones(1, 3)).sum().backward()
    opt.step()
    dst = nn.Linear(2, 3, bias=False)  # a (3, 2) parameter
    plain = torch.optim.SGD(dst.parameters(), lr=0.1, momentum=0.9)
    plain.load_state_dict(opt.state_dict())  # accepted!
    assert plain.state[dst.weight]["momentum_buffer"].shape == (3, 3)

    fresh = torch.optim.SGD(dst.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(dr.errors.OptimizerStateMismatchError) as info:
        prepare_optimizer_state(opt.state_dict(), fresh, dst)
    msg = str(info.value)
    assert "state[weight]['momentum_buffer'] has shape (3, 3), the parameter (3, 2)" in msg
    assert "named_parameters" in msg
    assert not fresh.state


def test_group_count_mismatch():
    model, _, opt = _adam_checkpoint()
    live = torch.optim.Adam([{"params": model.a.parameters()}, {"params": model.b.parameters()}])
    with pytest.raises(dr.errors.OptimizerStateMismatchError, match=r"1 parameter group\(s\), Adam has 2"):
        prepare_optimizer_state(opt.state_dict(), live, model)


def test_group_size_mismatch():
    model, _, opt = _adam_checkpoint()
    live = torch.optim.Adam(model.a.parameters())
    with pytest.raises(dr.errors.OptimizerStateMismatchError, match=r"saved \[4\], Adam has \[2\]"):
        prepare_optimizer_state(opt.state_dict(), live, model)


@pytest.mark.parametrize("other", [torch.optim.SGD, torch.optim.RMSprop, torch.optim.Adagrad])
def test_other_optimizer_class(other):
    model, _, opt = _adam_checkpoint()
    with pytest.raises(dr.errors.OptimizerStateMismatchError, match="not from a") as info:
        prepare_optimizer_state(opt.state_dict(), other(model.parameters(), lr=0.1), model)
    assert other.__name__ in str(info.value)


def test_not_an_optimizer_state_dict():
    model = TwinNet()
    with pytest.raises(dr.errors.OptimizerStateMismatchError, match="not an optimizer state dict"):
        prepare_optimizer_state({"weight": torch.ones(1)}, torch.optim.SGD(model.parameters(), lr=0.1), model)


@pytest.mark.parametrize("named", [False, True])
def test_reordered_modules_are_rematched_by_name(named):
    model, _, opt = _adam_checkpoint(named=named)
    saved = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    by_name = {n: copy.deepcopy(opt.state[p]) for n, p in model.named_parameters()}
    if not named:  # a foreign file without names stays positional: the toolkit's own files carry names
        saved["optimizer"] = canonical_optimizer_state(opt, model)

    target = TwinNetReordered(seed=9)
    live = torch.optim.Adam(target.named_parameters() if named else target.parameters(), lr=1e-2)
    prepared = prepare_optimizer_state(saved["optimizer"], live, target)
    live.load_state_dict(prepared)
    for name, p in target.named_parameters():
        assert_same(dict(live.state[p]), by_name[name], name)
    if named:
        assert live.param_groups[0]["param_names"] == [n for n, _ in target.named_parameters()]

    # plain torch pairs them by position: a.weight's state lands on b.weight (same shape: silently)
    plain = torch.optim.Adam(target.parameters(), lr=1e-2)
    plain.load_state_dict(saved["optimizer"])
    assert torch.equal(plain.state[target.b.weight]["exp_avg"], by_name["a.weight"]["exp_avg"])


@pytest.mark.parametrize(
    "wrapper, prefix",
    [
        (nn.DataParallel, "module."),
        (torch.compile, "_orig_mod."),
        (lambda m: torch.compile(nn.DataParallel(m)), "_orig_mod.module."),
    ],
)
def test_prefixed_param_names_are_normalised(wrapper, prefix):
    model, wrapped, opt = _adam_checkpoint(named=True, wrapper=wrapper)
    saved = opt.state_dict()
    assert saved["param_groups"][0]["param_names"][0] == prefix + "a.weight"
    by_name = {n[len(prefix) :]: copy.deepcopy(opt.state[p]) for n, p in wrapped.named_parameters()}

    for live_wrapper in (lambda m: m, nn.DataParallel):
        target = live_wrapper(TwinNetReordered())
        live = torch.optim.Adam(target.named_parameters(), lr=1e-2)
        live.load_state_dict(prepare_optimizer_state(saved, live, target))
        for name, p in dr.unwrap_model(target).named_parameters():
            assert_same(dict(live.state[p]), by_name[name], name)
        # the optimizer keeps its own names (torch would overwrite them with the saved ones)
        assert live.param_groups[0]["param_names"] == [n for n, _ in target.named_parameters()]

    # without a model, the optimizer's own prefixed names are normalised too
    target = nn.DataParallel(TwinNetReordered())
    live = torch.optim.Adam(target.named_parameters(), lr=1e-2)
    live.load_state_dict(prepare_optimizer_state(saved, live))
    assert_same(dict(live.state[target.module.a.weight]), by_name["a.weight"])


def test_different_parameter_names_are_an_error():
    model, _, opt = _adam_checkpoint(named=True)

    class Renamed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.c = nn.Linear(3, 3)

    target = Renamed()
    live = torch.optim.Adam(target.named_parameters(), lr=1e-2)
    with pytest.raises(dr.errors.OptimizerStateMismatchError) as info:
        prepare_optimizer_state(opt.state_dict(), live, target)
    msg = str(info.value)
    assert "'c.weight'" in msg and "'b.weight'" in msg and "not in checkpoint" in msg
    assert not live.state


def test_prepare_changes_nothing_and_result_trains():
    model, _, opt = _adam_checkpoint(named=True)
    saved = copy.deepcopy(opt.state_dict())  # state_dict() returns the live tensors themselves
    frozen = copy.deepcopy(saved)
    target = TwinNet(seed=5)
    target.load_state_dict(model.state_dict())
    live = torch.optim.Adam(target.parameters(), lr=1e-2)
    prepared = prepare_optimizer_state(saved, live, target)
    assert_same(saved, frozen)
    assert not live.state
    live.load_state_dict(prepared)
    batches = [(x[:, :3], torch.cat([y, y[:, :1]], dim=1)) for x, y in make_batches(3)]
    assert train_steps(target, live, batches) == train_steps(model, opt, batches)


# ---------------------------------------------------------------- optimizers with unusual state


def _lbfgs(model):
    opt = torch.optim.LBFGS(model.parameters(), history_size=3, max_iter=3)
    x, y = torch.randn(5, 3, generator=torch.Generator().manual_seed(0)), torch.ones(5, 3)

    def closure():
        opt.zero_grad()
        loss = (model(x) - y).square().sum()
        loss.backward()
        return loss

    return opt, closure


def test_lbfgs_history_lists_move_too():
    model = TwinNet()
    opt, closure = _lbfgs(model)
    for _ in range(2):
        opt.step(closure)
    state = opt.state[model.a.weight]
    assert isinstance(state["old_dirs"], list) and state["old_dirs"]
    kept = {k: (v if not isinstance(v, list) else list(v)) for k, v in state.items()}
    dr.optimizer_to(opt)  # in place: nothing replaced
    assert all(state[k] is v or state[k] == v for k, v in kept.items() if not isinstance(v, list))
    assert all(a is b for k in ("old_dirs", "old_stps", "ro") for a, b in zip(state[k], kept[k]))

    meta_model = TwinNet().to(META)
    meta_opt = torch.optim.LBFGS(meta_model.parameters(), history_size=3)
    meta_opt.state[meta_model.a.weight] = copy.deepcopy(dict(state))
    report = dr.tools.device_report(meta_model, meta_opt)
    assert "optimizer.state[a.weight]['old_dirs'][0] is on cpu, its parameter on meta" in report
    dr.optimizer_to(meta_opt)
    moved = meta_opt.state[meta_model.a.weight]
    for key in ("old_dirs", "old_stps", "ro", "d", "prev_flat_grad", "H_diag"):
        values = moved[key] if isinstance(moved[key], list) else [moved[key]]
        assert values and all(v.device == META for v in values), key
    assert [v is None for v in moved["al"]] == [v is None for v in state["al"]]
    assert moved["n_iter"] == state["n_iter"] and moved["prev_loss"] == state["prev_loss"]
    assert dr.tools.device_report(meta_model, meta_opt) == []


def test_lbfgs_resumes_and_continues_identically(tmp_path):
    model = TwinNet()
    opt, closure = _lbfgs(model)
    opt.step(closure)
    path = tmp_path / "lbfgs.pt"
    dr.save_checkpoint(path, model=model, optimizer=opt)
    model2 = TwinNet(seed=3)
    opt2, closure2 = _lbfgs(model2)
    dr.resume(path, model=model2, optimizer=opt2)
    assert opt2.step(closure2).item() == opt.step(closure).item()
    assert_same(model2.state_dict(), model.state_dict())


def test_sparse_adam_integer_step():
    emb = nn.Embedding(5, 3, sparse=True)
    opt = torch.optim.SparseAdam(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    opt.step()
    assert opt.state[emb.weight]["step"] == 1  # a Python int, not a tensor
    dr.optimizer_to(opt, META)
    assert opt.state[emb.weight]["step"] == 1 and opt.state[emb.weight]["exp_avg"].device == META


# ---------------------------------------------------------------- keys, regrouping refusals, coverage


def test_normaliser_lives_in_state_and_dcp_reads_the_same_one():
    from dist_resume._foreign import dcp
    from dist_resume._state.optim import keys as optim_keys

    # the name as dcp imported it: not re-exported, which is the point
    assert dcp.normalize_optimizer_state is optim_keys.normalize_optimizer_state  # type: ignore[attr-defined]
    mixed = {"state": {0: {}, "1": {}}, "param_groups": [{"params": [0, 1]}]}
    assert optim_keys.normalize_optimizer_state(mixed) is mixed  # not every key a digit string: left alone
    assert optim_keys.unfit_state_keys(mixed) == []  # '1' could be read as 1 ...
    with pytest.raises(dr.errors.OptimizerStateMismatchError, match=r"1 optimizer state entry fits no parameter.*'1'"):
        optim_keys.check_state_keys(mixed, "f.pt")  # ... but a half-normalised file is not guessed at


def test_regrouped_live_optimizer_without_names_is_refused():
    model, _, opt = _adam_checkpoint(named=True)
    live = torch.optim.Adam([{"params": model.a.parameters()}, {"params": model.b.parameters()}])
    unchanged = copy.deepcopy(live.state_dict())
    with pytest.raises(dr.errors.OptimizerStateMismatchError) as info:
        prepare_optimizer_state(opt.state_dict(), live)  # no model: the live parameters have no names
    msg = str(info.value)
    assert "1 parameter group(s), Adam has 2" in msg and "pass the model" in msg
    assert live.state_dict() == unchanged
    prepared = prepare_optimizer_state(opt.state_dict(), live, model)  # with the model they do
    assert [g["params"] for g in prepared["param_groups"]] == [[0, 1], [2, 3]]


def test_prepared_state_holds_only_what_is_applied():
    model = TwinNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.a(torch.ones(1, 3)).sum().backward()  # only a.* get a gradient, so only they get state
    opt.step()
    saved = opt.state_dict()
    saved["state"][3] = {}  # an empty entry applies nothing
    prepared = prepare_optimizer_state(saved, torch.optim.SGD(TwinNet().parameters(), lr=0.1), TwinNet())
    assert sorted(prepared["state"]) == [0, 1]
    assert state_coverage(prepared) == (2, 4)
    assert prepared["state"][0]["momentum_buffer"] is saved["state"][0]["momentum_buffer"]  # no copies
