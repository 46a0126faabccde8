"""Per-class optimizer state validation: every built-in torch.optim class, with a real saved state.

A valid state resumes (and the next step runs); a renamed key, a dropped key, a state tensor of another shape and one
of another dtype are each refused with OptimizerStateMismatchError naming the parameter and the key, before the model
or the optimizer changes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dist_resume as dr
from dist_resume._state.optim.per_class import _SPECS, check_optimizer_state

Build = Callable[[nn.Module], torch.optim.Optimizer]


class Net(nn.Module):
    def __init__(self, sparse: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(6, 3, sparse=sparse)
        self.fc = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(x)).sum()


# name -> (optimizer factory, the per-element key a mutation changes)
CASES: dict[str, tuple[Build, str]] = {
    "SGD-momentum": (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), "momentum_buffer"),
    "Adam": (lambda m: torch.optim.Adam(m.parameters()), "exp_avg"),
    "Adam-amsgrad": (lambda m: torch.optim.Adam(m.parameters(), amsgrad=True), "max_exp_avg_sq"),
    "AdamW": (lambda m: torch.optim.AdamW(m.parameters()), "exp_avg_sq"),
    "AdamW-amsgrad": (lambda m: torch.optim.AdamW(m.parameters(), amsgrad=True), "max_exp_avg_sq"),
    "Adagrad": (lambda m: torch.optim.Adagrad(m.parameters()), "sum"),
    "RMSprop": (lambda m: torch.optim.RMSprop(m.parameters()), "square_avg"),
    "RMSprop-centered-momentum": (
        lambda m: torch.optim.RMSprop(m.parameters(), centered=True, momentum=0.9),
        "grad_avg",
    ),
    "Adamax": (lambda m: torch.optim.Adamax(m.parameters()), "exp_inf"),
    "NAdam": (lambda m: torch.optim.NAdam(m.parameters()), "exp_avg"),
    "RAdam": (lambda m: torch.optim.RAdam(m.parameters()), "exp_avg_sq"),
    "ASGD": (lambda m: torch.optim.ASGD(m.parameters()), "ax"),
    "Rprop": (lambda m: torch.optim.Rprop(m.parameters()), "step_size"),
    "Adadelta": (lambda m: torch.optim.Adadelta(m.parameters()), "acc_delta"),
    "SparseAdam": (lambda m: torch.optim.SparseAdam(list(m.get_submodule("emb").parameters())), "exp_avg"),
    "LBFGS": (lambda m: torch.optim.LBFGS(m.parameters(), history_size=3, max_iter=3), "prev_flat_grad"),
}


def _model(name: str) -> Net:
    torch.manual_seed(0)
    return Net(sparse=name == "SparseAdam")


def _train(model: Net, opt: torch.optim.Optimizer, steps: int = 2) -> None:
    x = torch.tensor([[0, 1], [2, 3]])

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(x)
        loss.backward()
        return loss

    for _ in range(steps):
        if isinstance(opt, torch.optim.LBFGS):
            opt.step(closure)
        else:
            closure()
            opt.step()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One real dist_resume checkpoint per optimizer case, written after two steps."""
    folder = tmp_path_factory.mktemp("optim_state")
    paths = {}
    for name, (build, _) in CASES.items():
        model = _model(name)
        opt = build(model)
        _train(model, opt)
        paths[name] = Path(dr.save_checkpoint(folder / f"{name}.pt", model=model, optimizer=opt, step=2))
    return paths


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], Any]:
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


def _first_entry(ckpt: dict[str, Any]) -> dict[str, Any]:
    state = ckpt["optimizer"]["state"]
    return state[min(state)]


def _mutations(key: str) -> dict[str, tuple[Callable[[dict[str, Any]], None], str]]:
    def rename(e: dict[str, Any]) -> None:
        e["D" + key[1:]] = e.pop(key)

    def drop(e: dict[str, Any]) -> None:
        del e[key]

    def reshape(e: dict[str, Any]) -> None:
        e[key] = torch.cat([e[key].reshape(-1), e[key].reshape(-1)[:1]])

    def retype(e: dict[str, Any]) -> None:
        e[key] = e[key].to(torch.int64)

    return {
        "renamed": (rename, rf"lacks {key!r}.*has 'D{key[1:]}', which \w+ never writes"),
        "dropped": (drop, rf"lacks {key!r}"),
        # the pairing check (optim/match.py: check_state_shapes) words it first: "state[name][key] has shape ..."
        "wrong shape": (reshape, rf"{key!r}\]? (is|has) shape \(\d+,\)"),
        "wrong dtype": (retype, rf"{key!r} is dtype torch.int64, expected a floating dtype"),
    }


@pytest.mark.parametrize("name", list(CASES))
def test_each_builtin_optimizer_resumes_a_valid_state_and_refuses_each_damage(
    name: str, saved: dict[str, Path], tmp_path: Path
) -> None:
    build, key = CASES[name]
    model = _model(name)
    opt = build(model)
    result = dr.resume(saved[name], model=model, optimizer=opt)
    assert "optimizer" in result.restored
    _train(model, opt, steps=1)  # the restored state steps

    good = torch.load(saved[name], weights_only=True)
    param_name = "emb.weight"  # the first parameter of every case
    for what, (mutate, match) in _mutations(key).items():
        if name == "SGD-momentum" and what == "dropped":
            continue  # SGD's only key: an entry without it is {}, what torch keeps for a parameter not yet stepped
        ckpt = copy.deepcopy(good)
        mutate(_first_entry(ckpt))
        path = tmp_path / f"{what.replace(' ', '_')}.pt"
        torch.save(ckpt, path)
        model = _model(name)
        opt = build(model)
        _train(model, opt, steps=1)  # live state that a half-restore would overwrite
        before = _snapshot(model, opt)
        with pytest.raises(dr.errors.OptimizerStateMismatchError, match=match) as err:
            dr.resume(path, model=model, optimizer=opt)
        assert f"state[{param_name}]" in str(err.value), (what, str(err.value))
        after = _snapshot(model, opt)
        assert _same(before[0], after[0]) and _same(before[1], after[1]), f"{name}/{what}: something changed"


def test_the_step_counter_is_checked_too(saved: dict[str, Path], tmp_path: Path) -> None:
    good = torch.load(saved["Adam"], weights_only=True)
    for value, match in [
        (None, "'step' is NoneType"),
        (torch.ones(3), r"'step' is a tensor of shape \(3,\)"),
        (torch.tensor(1 + 2j), "'step' is a torch.complex64 tensor"),
        ("Dtep", "lacks 'step'.*has 'Dtep', which Adam never writes"),  # the fuzz finding, with a valid CRC
    ]:
        ckpt = copy.deepcopy(good)
        entry = _first_entry(ckpt)
        if value == "Dtep":
            entry["Dtep"] = entry.pop("step")
        else:
            entry["step"] = value
        torch.save(ckpt, tmp_path / "s.pt")
        with pytest.raises(dr.errors.OptimizerStateMismatchError, match=match):
            dr.resume(tmp_path / "s.pt", model=_model("Adam"), optimizer=CASES["Adam"][0](_model("Adam")))


def test_the_table_is_what_torch_writes() -> None:
    """Each class's required keys are exactly the keys torch creates for an entry (a torch upgrade that adds or
    renames one fails here, not in a user's resume)."""
    for name, (build, _) in CASES.items():
        model = _model(name)
        opt = build(model)
        _train(model, opt)
        spec = _SPECS.get(type(opt))
        group = opt.param_groups[0]
        for p in group["params"]:
            entry = opt.state.get(p)
            if not entry or spec is None:
                continue
            assert set(entry) == spec.per_element(group) | spec.scalars, name


def test_options_come_from_the_groups_that_will_be_loaded(saved: dict[str, Path]) -> None:
    """optimizer_hparams='current' keeps the live amsgrad=True: the saved Adam state lacks max_exp_avg_sq, and
    torch's step would raise KeyError after the load; the checkpoint's amsgrad=False loads fine."""
    model = _model("Adam")
    opt = torch.optim.Adam(model.parameters(), amsgrad=True)
    with pytest.raises(dr.errors.OptimizerStateMismatchError, match="lacks 'max_exp_avg_sq'"):
        dr.resume(saved["Adam"], model=model, optimizer=opt, options=dr.ResumeOptions(optimizer_hparams="current"))
    dr.resume(saved["Adam"], model=model, optimizer=opt)
    assert opt.param_groups[0]["amsgrad"] is False


def test_subclasses_and_custom_classes() -> None:
    model = _model("Adam")

    class Renamed(torch.optim.Adam):  # same step: the table applies
        pass

    class OwnStep(torch.optim.Adam):  # its own step: generic checks only
        def step(self, closure: Any = None) -> Any:
            return super().step(closure)

    for cls, refused in ((Renamed, True), (OwnStep, False)):
        opt: torch.optim.Optimizer = cls(model.parameters())
        _train(model, opt)
        sd = opt.state_dict()
        del sd["state"][0]["exp_avg"]
        if refused:
            with pytest.raises(
                dr.errors.OptimizerStateMismatchError, match=r"does not fit Adam: state\[#0 \(group 0\)\]"
            ):
                check_optimizer_state(sd, opt)
        else:
            check_optimizer_state(sd, opt)

    class Masked(torch.optim.SGD):  # a custom per-element bool mask is its own business
        def step(self, closure: Any = None) -> Any:
            for p in self.param_groups[0]["params"]:
                self.state[p]["mask"] = torch.ones_like(p, dtype=torch.bool)
            return super().step(closure)

    opt = Masked(model.parameters(), lr=0.1)
    _train(model, opt)
    check_optimizer_state(opt.state_dict(), opt)
    sd = opt.state_dict()
    sd["state"][0] = [1, 2]
    with pytest.raises(dr.errors.OptimizerStateMismatchError, match=r"state\[#0 \(group 0\)\]: is list"):
        check_optimizer_state(sd, opt)


def test_lbfgs_state_belongs_under_the_first_parameter(saved: dict[str, Path], tmp_path: Path) -> None:
    good = torch.load(saved["LBFGS"], weights_only=True)
    for mutate, match in [
        (lambda s: s.__setitem__(1, {"n_iter": 1, "func_evals": 1}), r"state\[fc.weight\]: holds state, but LBFGS"),
        (lambda s: s[0].__setitem__("old_dirs", [torch.ones(2)]), r"old_dirs\[0\] is shape \(2,\), expected \(26,\)"),
        (lambda s: s[0].__setitem__("n_iter", "3"), r"'n_iter' is str '3', where a number belongs"),
    ]:
        ckpt = copy.deepcopy(good)
        mutate(ckpt["optimizer"]["state"])
        torch.save(ckpt, tmp_path / "l.pt")
        model = _model("LBFGS")
        with pytest.raises(dr.errors.OptimizerStateMismatchError, match=match):
            dr.resume(tmp_path / "l.pt", model=model, optimizer=CASES["LBFGS"][0](model))


@pytest.mark.parametrize(
    ("build", "dropped", "required"),
    [
        (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), "lr", "dampening lr momentum weight_decay"),
        (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), "momentum", None),
        (lambda m: torch.optim.AdamW(m.parameters(), lr=0.01), "betas", "betas eps lr weight_decay"),
        (lambda m: torch.optim.LBFGS(m.parameters(), history_size=2), "history_size", None),
    ],
)
def test_a_group_without_a_hyperparameter_step_reads_is_refused_naming_it(
    build: Callable[[nn.Module], torch.optim.Optimizer], dropped: str, required: str | None, tmp_path: Path
) -> None:
    """The keys are the live optimizer's ``defaults`` less what torch's load fills in: a group without one resumed
    and the first ``step()`` raised ``KeyError`` (issue 45); ``optimizer_hparams="current"`` keeps the live ones."""
    from dist_resume._checkpoint.plan.hparams import required_hyperparameters

    model = _model("Adam")
    opt = build(model)
    _train(model, opt)
    if required is not None:
        assert sorted(required_hyperparameters(opt)) == required.split()
    saved = dr.save_checkpoint(tmp_path / "good.pt", model=model, optimizer=opt)
    ckpt = torch.load(saved, weights_only=True)
    del ckpt["optimizer"]["param_groups"][0][dropped]
    torch.save(ckpt, tmp_path / "bad.pt")
    model = _model("Adam")
    opt = build(model)
    _train(model, opt, steps=1)
    before = _snapshot(model, opt)
    with pytest.raises(dr.errors.OptimizerStateMismatchError, match=f"group 0 lacks '{dropped}'") as err:
        dr.resume(tmp_path / "bad.pt", model=model, optimizer=opt)
    assert "optimizer_hparams='current'" in str(err.value)
    assert all(map(_same, before, _snapshot(model, opt)))
    dr.resume(tmp_path / "bad.pt", model=model, optimizer=opt, options=dr.ResumeOptions(optimizer_hparams="current"))
    _train(model, opt, steps=1)


def test_a_hyperparameter_torchs_load_fills_in_is_not_required() -> None:
    """What an older torch did not write (SGD's ``nesterov``, Adam's ``decoupled_weight_decay``), torch's
    ``__setstate__`` sets on load: such a file resumes. A class whose own ``__setstate__`` replaces torch's has its
    code left alone (every key of its ``defaults`` is required), and a wrapper put on torch's later is not run."""
    from dist_resume._checkpoint.plan.hparams import check_hyperparameters, required_hyperparameters

    model = _model("Adam")
    sgd, adam = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.Adam(model.parameters())
    assert {"nesterov", "maximize", "foreach"}.isdisjoint(required_hyperparameters(sgd))
    assert "decoupled_weight_decay" not in required_hyperparameters(adam)
    group = {k: v for k, v in adam.param_groups[0].items() if k != "decoupled_weight_decay"}
    check_hyperparameters([group], adam, "old.pt")

    class Own(torch.optim.SGD):
        def __setstate__(self, state: dict[str, Any]) -> None:
            raise AssertionError("a file's check ran the class's own code")

    assert "nesterov" in required_hyperparameters(Own(model.parameters(), lr=0.1))
    calls = []
    original = torch.optim.SGD.__setstate__
    try:
        torch.optim.SGD.__setstate__ = lambda self, state: calls.append(1)  # type: ignore[method-assign]
        assert required_hyperparameters(sgd) == frozenset({"lr", "momentum", "dampening", "weight_decay"})
    finally:
        torch.optim.SGD.__setstate__ = original  # type: ignore[method-assign]
    assert not calls
