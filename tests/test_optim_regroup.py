"""Optimizer state that does not key like its param groups, and optimizers whose groups changed since the save.

Never a silent half-restore: state keyed by digit strings (what torch's ``dcp_to_torch_save`` writes) or by
parameter names (DSD's ``get_state_dict``) is re-keyed, anything else that fits no parameter is refused; a
regrouped optimizer (one group split into decay / no-decay, like HF Trainer and timm do) gets each
parameter's state by name and keeps its own hyper-parameters.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dist_resume as dr
from dist_resume._state.optim.keys import state_coverage
from dist_resume._state.optim.prepare import prepare_optimizer_state
from tests.models import TwinNet, assert_same, make_batches, single_rank_group, train_steps

ADAM_KEYS = ("exp_avg", "exp_avg_sq", "step")


def _trained(named: bool = False, wrapper: Any = None, cls: Any = torch.optim.Adam, **kwargs: Any):
    model = TwinNet(seed=5)
    wrapped = wrapper(model) if wrapper else model
    params = wrapped.named_parameters() if named else wrapped.parameters()
    opt = cls(params, **{"lr": 1e-2, **kwargs})
    train_steps(model, opt, [(torch.randn(4, 3), torch.randn(4, 3)) for _ in range(2)])
    return model, opt


def _by_name(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    return {n: copy.deepcopy(dict(opt.state[p])) for n, p in dr.unwrap_model(model).named_parameters()}


def _assert_state_by_name(model: nn.Module, opt: torch.optim.Optimizer, expected: dict[str, dict[str, Any]]) -> None:
    for name, p in dr.unwrap_model(model).named_parameters():
        got = opt.state.get(p)
        assert got, f"{name} got no state"
        for key in ADAM_KEYS:
            assert torch.equal(got[key], expected[name][key]), (name, key)


def _save(path: Path, model: nn.Module, osd: dict[str, Any]) -> Path:
    torch.save({"model": model.state_dict(), "optimizer": osd}, path)
    return path


def _unchanged(model: nn.Module, opt: torch.optim.Optimizer):
    """A check that ``model`` and ``opt`` are as they were when this was called."""
    weights = copy.deepcopy(model.state_dict())
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    ids = [[id(p) for p in g["params"]] for g in opt.param_groups]
    state = copy.deepcopy({id(p): dict(s) for p, s in opt.state.items()})

    def check() -> None:
        assert_same(model.state_dict(), weights)
        assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups
        assert [[id(p) for p in g["params"]] for g in opt.param_groups] == ids
        now = {id(p): dict(s) for p, s in opt.state.items()}
        assert now.keys() == state.keys()
        for key, entry in state.items():
            assert_same(now[key], entry)
        assert all(not isinstance(k, (str, int)) for k in opt.state)  # no orphan keys were stored

    return check


# ---------------------------------------------------------------- state keyed unlike its groups


def _digit_strings(opt: torch.optim.Optimizer) -> dict[str, Any]:
    sd = opt.state_dict()  # what dcp_to_torch_save writes (FACTS 21), built by hand
    sd["state"] = {str(k): v for k, v in sd["state"].items()}
    return sd


def test_torch_alone_drops_digit_string_state_silently() -> None:
    """The bug: plain load_state_dict accepts it and no parameter gets state (FACTS 21)."""
    _, opt = _trained()
    target = TwinNet()
    plain = torch.optim.Adam(target.parameters(), lr=1e-2)
    plain.load_state_dict(_digit_strings(opt))
    assert not any(plain.state.get(p) for p in target.parameters())


def test_digit_string_state_resumes_fully(tmp_path: Path) -> None:
    model, opt = _trained()
    expected = _by_name(model, opt)
    path = _save(tmp_path / "digits.pt", model, _digit_strings(opt))
    target = TwinNet(seed=1)
    live = torch.optim.Adam(target.parameters(), lr=1e-2)
    result = dr.resume(path, model=target, optimizer=live, options=dr.ResumeOptions(strict=True))
    assert "optimizer" in result.restored
    _assert_state_by_name(target, live, expected)
    assert all(isinstance(k, torch.Tensor) for k in live.state)  # no '0'..'3' entries left behind


def test_digit_string_state_prepared_with_int_keys() -> None:
    model, opt = _trained()
    sd = _digit_strings(opt)
    frozen = copy.deepcopy(sd)
    prepared = prepare_optimizer_state(sd, torch.optim.Adam(TwinNet().parameters()), TwinNet())
    assert set(prepared["state"]) == {0, 1, 2, 3}
    assert state_coverage(prepared) == (4, 4)
    assert_same(sd, frozen)  # the input is not changed


@pytest.mark.parametrize(
    "rekey, named",
    [
        (lambda s: {**s, 7: s[0]}, [7]),  # an int id no group lists
        (lambda s: {**{str(k): v for k, v in s.items()}, "9": s[0]}, ["9"]),  # digit strings, one fits nothing
        (lambda s: {**s, "0": s[0]}, ["0"]),  # the same id in both forms: ambiguous
        (lambda s: {"fc.weight": s[0]}, ["fc.weight"]),  # a name in a positional file
    ],
)
def test_state_that_fits_no_parameter_is_refused(tmp_path: Path, rekey: Any, named: list[Any]) -> None:
    model, opt = _trained()
    sd = opt.state_dict()
    sd["state"] = rekey(sd["state"])
    target = TwinNet(seed=1)
    live = torch.optim.Adam(target.parameters(), lr=1e-2)
    with pytest.raises(dr.errors.OptimizerStateMismatchError) as info:
        prepare_optimizer_state(sd, live, target)
    msg = str(info.value)
    assert all(repr(k) in msg for k in named), msg
    assert "no parameter of the saved param_groups" in msg and "Nothing was restored" in msg
    unchanged = _unchanged(target, live)
    with pytest.raises(dr.errors.OptimizerStateMismatchError):
        dr.resume(_save(tmp_path / "orphan.pt", model, sd), model=target, optimizer=live)
    unchanged()


def _fqn_keyed(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """DSD's ``get_state_dict`` form: state keys and each group's ``params`` are parameter names."""
    sd = opt.state_dict()
    names = [n for n, _ in model.named_parameters()]
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]]
    return {"state": {names[i]: v for i, v in sd["state"].items()}, "param_groups": groups}


def test_fqn_keyed_state_is_matched_by_name(tmp_path: Path) -> None:
    model, opt = _trained()
    expected = _by_name(model, opt)
    fqn = _fqn_keyed(model, opt)
    target = TwinNet(seed=1)
    live = torch.optim.Adam(target.parameters(), lr=1e-2)
    prepared = prepare_optimizer_state(fqn, live, target)
    assert sorted(prepared["state"]) == [0, 1, 2, 3]
    live.load_state_dict(prepared)
    _assert_state_by_name(target, live, expected)

    target2 = TwinNet(seed=2)
    live2 = torch.optim.Adam(target2.parameters(), lr=1e-2)
    dr.resume(_save(tmp_path / "fqn.pt", model, fqn), model=target2, optimizer=live2)
    _assert_state_by_name(target2, live2, expected)


def test_fqn_keyed_state_with_an_unknown_name_is_refused() -> None:
    model, opt = _trained()
    fqn = _fqn_keyed(model, opt)
    fqn["state"]["c.weight"] = fqn["state"]["a.weight"]
    live = torch.optim.Adam(TwinNet().parameters(), lr=1e-2)
    with pytest.raises(dr.errors.OptimizerStateMismatchError, match=r"'c\.weight'"):
        prepare_optimizer_state(fqn, live, TwinNet())


# ---------------------------------------------------------------- regrouped optimizers


def _decay_split(model: nn.Module, **group_kwargs: Any) -> list[dict[str, Any]]:
    """HF Trainer / timm style: weights decay, biases do not."""
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if not n.endswith("bias")], "weight_decay": 0.05, **group_kwargs},
        {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0, **group_kwargs},
    ]


def test_regrouped_adamw_restores_state_by_name(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, opt = _trained(cls=torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    expected = _by_name(model, opt)
    path = tmp_path / "one_group.pt"
    dr.save_checkpoint(path, model=model, optimizer=opt, step=2)  # dist_resume's files carry param_names

    target = TwinNet(seed=1)
    live = torch.optim.AdamW(_decay_split(target), lr=5e-2)
    caplog.set_level(logging.WARNING, logger="dist_resume")
    result = dr.resume(path, model=target, optimizer=live)

    assert "optimizer" in result.restored
    _assert_state_by_name(target, live, expected)
    assert [g["lr"] for g in live.param_groups] == [5e-2, 5e-2]  # the live hyper-parameters are kept
    assert [g["weight_decay"] for g in live.param_groups] == [0.05, 0.0]
    assert [len(g["params"]) for g in live.param_groups] == [2, 2]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "dist_resume"]
    assert any("1 group of 4 params in the file, 2 groups of 2+2 now" in w for w in warnings), warnings
    assert any("hyper-parameters come from the live AdamW" in w for w in warnings), warnings


def test_regrouped_with_the_same_hyperparameters_trains_identically() -> None:
    model, opt = _trained(cls=torch.optim.AdamW, named=True, lr=1e-2, weight_decay=0.1)
    target = TwinNet(seed=1)
    target.load_state_dict(model.state_dict())
    live = torch.optim.AdamW(_decay_split(target, weight_decay=0.1), lr=1e-2)
    saved = copy.deepcopy(opt.state_dict())  # state_dict() returns the live tensors themselves
    live.load_state_dict(prepare_optimizer_state(saved, live, target))
    batches = [(x[:, :3], torch.cat([y, y[:, :1]], dim=1)) for x, y in make_batches(3)]
    assert train_steps(target, live, batches) == train_steps(model, opt, batches)
    assert_same(target.state_dict(), model.state_dict())


@pytest.mark.parametrize(
    "split, described",
    [
        (
            lambda m: [{"params": [m.a.weight, m.b.weight, m.a.bias]}, {"params": [m.b.bias], "lr": 0.5}],
            "2 groups of 3+1",
        ),
        (
            lambda m: [{"params": [m.b.weight]}, {"params": [m.a.weight]}, {"params": [m.a.bias, m.b.bias]}],
            "3 groups of 1+1+2",
        ),
        (lambda m: [{"params": [m.b.weight, m.a.bias]}, {"params": [m.a.weight, m.b.bias]}], "moved between groups"),
    ],
)
def test_groups_regrouped_any_way(split: Any, described: str, caplog: pytest.LogCaptureFixture) -> None:
    model, opt = _trained(named=True)
    saved = opt.state_dict()
    saved["param_groups"] = [  # two saved groups of 2+2: a.*, b.*
        {**saved["param_groups"][0], "params": [0, 1], "param_names": ["a.weight", "a.bias"]},
        {**saved["param_groups"][0], "params": [2, 3], "param_names": ["b.weight", "b.bias"]},
    ]
    expected = _by_name(model, opt)
    target = TwinNet(seed=1)
    live = torch.optim.Adam(split(target), lr=1e-3)
    caplog.set_level(logging.WARNING, logger="dist_resume")
    prepared = prepare_optimizer_state(saved, live, target)
    assert state_coverage(prepared) == (4, 4)
    live.load_state_dict(prepared)
    _assert_state_by_name(target, live, expected)
    assert [g["lr"] for g in live.param_groups] == [g.get("lr", 1e-3) for g in split(TwinNet())]
    assert any(described in r.getMessage() for r in caplog.records), caplog.text
    assert "2 groups of 2+2 params in the file" in caplog.text


def test_regrouped_without_names_is_refused(tmp_path: Path) -> None:
    model, opt = _trained(cls=torch.optim.AdamW)  # built from parameters(): torch stores no names
    assert "param_names" not in opt.state_dict()["param_groups"][0]
    path = _save(tmp_path / "nameless.pt", model, opt.state_dict())
    target = TwinNet(seed=1)
    live = torch.optim.AdamW(_decay_split(target), lr=5e-2)
    unchanged = _unchanged(target, live)
    with pytest.raises(dr.errors.OptimizerStateMismatchError) as info:
        dr.resume(path, model=target, optimizer=live)
    msg = str(info.value)
    assert "1 parameter group(s), AdamW has 2" in msg  # today's wording is kept
    assert "named_parameters()" in msg and "dist_resume" in msg
    unchanged()


def test_ddp_prefixed_names_regroup_into_a_plain_model(tmp_path: Path) -> None:
    model, opt = _trained(named=True, wrapper=nn.DataParallel, cls=torch.optim.AdamW)
    saved = opt.state_dict()
    assert saved["param_groups"][0]["param_names"][0] == "module.a.weight"
    expected = _by_name(model, opt)
    target = TwinNet(seed=1)
    live = torch.optim.AdamW(_decay_split(target), lr=5e-2)
    dr.resume(_save(tmp_path / "ddp.pt", nn.DataParallel(model), saved), model=target, optimizer=live)
    _assert_state_by_name(target, live, expected)
    assert [g["weight_decay"] for g in live.param_groups] == [0.05, 0.0]


class _Grown(TwinNet):
    """TwinNet with one more layer: its parameters are genuinely new."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.c = nn.Linear(3, 3)


def test_regrouped_with_new_or_vanished_parameters(caplog: pytest.LogCaptureFixture) -> None:
    model, opt = _trained(named=True, cls=torch.optim.AdamW)
    expected = _by_name(model, opt)
    target = _Grown(seed=1)
    live = torch.optim.AdamW(_decay_split(target), lr=5e-2)
    with pytest.raises(dr.errors.OptimizerStateMismatchError) as info:
        prepare_optimizer_state(opt.state_dict(), live, target)
    msg = str(info.value)
    assert "not in checkpoint (2: 'c.weight', 'c.bias')" in msg and "strict=False" in msg

    caplog.set_level(logging.WARNING, logger="dist_resume")
    prepared = prepare_optimizer_state(opt.state_dict(), live, target, strict=False)
    assert state_coverage(prepared) == (4, 6)
    live.load_state_dict(prepared)
    for name, p in target.named_parameters():
        if name.startswith("c."):
            assert not live.state.get(p), name  # new parameters start fresh
        else:
            assert all(torch.equal(live.state[p][k], expected[name][k]) for k in ADAM_KEYS), name
    assert "'c.weight'" in caplog.text

    # the other way round: the file names parameters the live model no longer has
    grown = _Grown(seed=2)
    grown_opt = torch.optim.AdamW(grown.named_parameters(), lr=1e-2)
    train_steps(grown, grown_opt, [(torch.randn(4, 3), torch.randn(4, 3))])
    small = TwinNet(seed=3)
    small_opt = torch.optim.AdamW(_decay_split(small), lr=5e-2)
    with pytest.raises(dr.errors.OptimizerStateMismatchError, match=r"only in checkpoint \(2: 'c.weight', 'c.bias'\)"):
        prepare_optimizer_state(grown_opt.state_dict(), small_opt, small)
    prepared = prepare_optimizer_state(grown_opt.state_dict(), small_opt, small, strict=False)
    assert state_coverage(prepared) == (4, 4) and len(prepared["state"]) == 4  # c.*'s state is not applied


def test_nothing_fits_by_name_is_refused_even_without_strict() -> None:
    model, opt = _trained(named=True)

    class Other(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.x = nn.Linear(3, 3)
            self.y = nn.Linear(3, 3)

    target = Other()
    groups: list[dict[str, Any]] = [{"params": [target.x.weight]}, {"params": [target.x.bias, *target.y.parameters()]}]
    live = torch.optim.Adam(groups)
    with pytest.raises(dr.errors.OptimizerStateMismatchError, match="no parameter"):
        prepare_optimizer_state(opt.state_dict(), live, target, strict=False)


def test_a_refused_regroup_changes_nothing(tmp_path: Path) -> None:
    model, opt = _trained(named=True, cls=torch.optim.AdamW)
    saved = copy.deepcopy(opt.state_dict())
    saved["state"][3]["exp_avg"] = torch.zeros(4)  # b.bias's state no longer fits b.bias
    path = _save(tmp_path / "bad_shape.pt", model, saved)
    target = TwinNet(seed=1)
    live = torch.optim.AdamW(_decay_split(target), lr=5e-2)
    train_steps(target, live, [(torch.randn(4, 3), torch.randn(4, 3))])  # live state exists already
    unchanged = _unchanged(target, live)
    for strict in (True, False):
        with pytest.raises(
            dr.errors.OptimizerStateMismatchError, match=r"state\[b\.bias\]\['exp_avg'\] has shape \(4,\)"
        ):
            dr.resume(path, model=target, optimizer=live, options=dr.ResumeOptions(strict=strict))
        unchanged()


def test_regrouped_and_digit_string_state_through_broadcast_loading(tmp_path: Path) -> None:
    """broadcast_from_rank0 plans on stand-ins and rebinds by tensor identity: the prepared state must keep it."""
    model, opt = _trained(named=True, cls=torch.optim.AdamW)
    expected = _by_name(model, opt)
    dr.save_checkpoint(tmp_path / "named.pt", model=model, optimizer=opt)
    plain, plain_opt = _trained()
    plain_expected = _by_name(plain, plain_opt)
    digits = _save(tmp_path / "digits.pt", plain, _digit_strings(plain_opt))
    with single_rank_group(tmp_path):
        target = TwinNet(seed=1)
        live = torch.optim.AdamW(_decay_split(target), lr=5e-2)
        dr.resume(
            tmp_path / "named.pt", model=target, optimizer=live, options=dr.ResumeOptions(broadcast_from_rank0=True)
        )
        target2 = TwinNet(seed=1)
        live2 = torch.optim.Adam(target2.parameters(), lr=1e-2)
        dr.resume(digits, model=target2, optimizer=live2, options=dr.ResumeOptions(broadcast_from_rank0=True))
    _assert_state_by_name(target, live, expected)
    assert [g["weight_decay"] for g in live.param_groups] == [0.05, 0.0]
    _assert_state_by_name(target2, live2, plain_expected)
