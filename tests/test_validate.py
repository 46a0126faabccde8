"""The checks of a checkpoint's small states before anything loads them: a GradScaler state in full before
GradScaler.load_state_dict sees it; and validation that is total, for the scheduler, the sampler position and the
optimizer state: whatever a damaged file holds where a number, a flag or a str key belongs (a tensor, a huge int, NaN,
an int key among str keys), the check raises its typed error and formats its message, never a raw exception."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import dist_resume as dr
from dist_resume._core.text import described, preview, shown
from dist_resume._state.optim.keys import check_state_keys, normalize_optimizer_state, unfit_state_keys
from dist_resume._state.optim.per_class import check_optimizer_state
from dist_resume._state.validate import check_scaler, check_scheduler, is_number
from dist_resume.errors import OptimizerStateMismatchError, StateMismatchError


def _scaler(enabled: bool = True) -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", enabled=enabled)


def test_a_scaler_state_from_state_dict_passes_and_loads() -> None:
    saved = _scaler().state_dict()
    live = _scaler()
    check_scaler(saved, live, "ckpt.pt")
    live.load_state_dict(saved)


@pytest.mark.parametrize(
    ("change", "found"),
    [
        (lambda sd: sd.pop("growth_interval"), "growth_interval: missing"),
        (lambda sd: sd.update(scale="big"), "scale: str"),
        (lambda sd: sd.update(_growth_tracker={"a": 1}), "_growth_tracker: dict"),
        (lambda sd: sd.update(backoff_factor=True), "backoff_factor: bool"),
    ],
)
def test_a_mutated_scaler_state_is_refused_before_load_state_dict(change, found) -> None:
    saved = _scaler().state_dict()
    change(saved)
    live = _scaler()
    before = live.state_dict()
    with pytest.raises(StateMismatchError, match=r"ckpt\.pt: the GradScaler state") as info:
        check_scaler(saved, live, "ckpt.pt")
    assert found in str(info.value)
    assert live.state_dict() == before


def test_a_disabled_scaler_ignores_the_saved_state() -> None:
    check_scaler({"scale": "anything"}, _scaler(enabled=False), "ckpt.pt")


def test_a_scaler_number_past_int64_is_refused() -> None:  # is_number: float() of one overflows
    saved = {**_scaler().state_dict(), "growth_interval": 10**400}
    with pytest.raises(StateMismatchError, match="growth_interval: int"):
        check_scaler(saved, _scaler(), "ckpt.pt")
    assert not is_number(10**400) and not is_number(-(2**63)) and is_number(2**63 - 1) and is_number(math.nan)


# ------------------------------------------------------------------ messages: the values a damaged file holds


class _Hostile:
    def __repr__(self) -> str:
        raise KeyError("gone")


def test_a_value_repr_cannot_show_is_described_by_its_kind() -> None:
    assert described(10**5000) == "an int of 16610 bits" and described(-(10**5000)).startswith("a negative int")
    assert preview([10**5000, "a"]) == "an int of 16610 bits, 'a'"
    assert shown(10**5000) == "an int of 16610 bits" and shown(_Hostile()) == "a _Hostile that cannot be shown"


# ------------------------------------------------------------------ the LR scheduler


def _step_lr() -> Any:
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    return torch.optim.lr_scheduler.StepLR(opt, 2)


def test_a_scheduler_state_with_an_int_key_among_str_keys_is_refused_naming_it() -> None:
    saved: dict[Any, Any] = {**_step_lr().state_dict(), 0: 1, "zz": 2}  # sorting them for the message: TypeError
    with pytest.raises(StateMismatchError, match=r"saved keys \['zz', 0\] not expected"):
        check_scheduler(saved, _step_lr(), "ckpt.pt")


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("last_epoch", math.nan),  # a float NaN where an int is expected
        ("last_epoch", math.inf),
        ("last_epoch", 10**400),  # an int past int64
        ("last_epoch", torch.ones(3)),  # a tensor of many values where a number is
        ("step_size", "2"),
        ("_is_initial", torch.tensor(True)),  # a flag's place: a tensor, whose truth value is the live object's problem
        ("base_lrs", [0.1, 0.1]),  # one per param group: this optimizer has one
        ("base_lrs", [10**400]),
        ("base_lrs", {"0": 0.1}),  # a dict where a list is expected
    ],
)
def test_a_scheduler_value_of_another_kind_is_refused_before_the_load(key: str, value: Any) -> None:
    live = _step_lr()
    saved = {**live.state_dict(), key: value}
    with pytest.raises(StateMismatchError, match=f"values of another kind than StepLR's \\({key}="):
        check_scheduler(saved, live, "ckpt.pt")
    check_scheduler({**live.state_dict(), "gamma": 1, "last_epoch": 7}, live, "ckpt.pt")  # other values of its kind


# ------------------------------------------------------------------ the sampler position


@pytest.mark.parametrize(
    ("key", "value", "said"),
    [
        ("shuffle", torch.ones(3), "shuffle=tensor([1., 1., 1.]) is not a bool"),  # bool(tensor) raised RuntimeError
        ("shuffle", torch.zeros(0), "is not a bool"),
        ("seed", torch.tensor([0, 0]), "seed=tensor([0, 0]) is not an int"),
        ("world_size", math.nan, "world_size=nan is not a positive int"),  # int(NaN) raised in the load, half-way
        ("world_size", "2", "is not a positive int"),
        ("world_size", 0, "is not a positive int"),
        ("epoch", 2**63, "is not a non-negative int within int64"),
        ("consumed", 1.0, "is not a non-negative int"),
        ("drop_last", None, "drop_last=None is not a bool"),
    ],
)
def test_a_sampler_field_of_another_type_is_refused_naming_it(key: str, value: Any, said: str) -> None:
    sampler = dr.ResumableDistributedSampler(list(range(8)), num_replicas=1, rank=0)
    saved = {**sampler.state_dict(), key: value}
    before = sampler.state_dict()
    with pytest.raises(StateMismatchError, match="sampler state: sampler ") as info:
        sampler.load_state_dict(saved)
    assert said in str(info.value)
    assert sampler.state_dict() == before


# ------------------------------------------------------------------ the optimizer state


def _adam() -> tuple[torch.optim.Optimizer, dict[str, Any]]:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    return opt, opt.state_dict()


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (lambda e: e.update({7: torch.zeros(1)}), "has 7, which Adam never writes"),  # raised KeyError: '7'
        (lambda e: e.update({0: 1, "zz": 2}), "has 'zz', 0, which"),
        (lambda e: e.update(step=10**400), "'step' is int 1000"),  # float() in torch's load raised OverflowError
        (lambda e: e.update(step=math.nan), "'step' is nan, where a finite number belongs"),
        (lambda e: e.update(step=torch.tensor(math.inf)), "a tensor holding inf, where a finite number belongs"),
        (lambda e: e.update(step=torch.ones(2)), "a tensor of shape (2,), where one number belongs"),
        # AdamW's first step() took the square root of 1 - beta2 ** (step + 1): a negative step failed there
        (lambda e: e.update(step=torch.tensor(-5.0)), "'step' is a tensor holding -5.0, where a count from 0 belongs"),
        (lambda e: e.update(step=-1), "'step' is -1, where a count from 0 belongs"),
    ],
)
def test_an_optimizer_entry_with_odd_keys_or_counters_is_refused_naming_them(edit: Any, said: str) -> None:
    opt, saved = _adam()
    edit(saved["state"][0])
    with pytest.raises(OptimizerStateMismatchError, match="does not fit Adam") as info:
        check_optimizer_state(saved, opt)
    assert said in str(info.value), str(info.value)


@pytest.mark.parametrize(
    "key", ["\u00b2", "\u0661", "9" * 5000]
)  # '²'.isdigit(), Arabic-Indic one; past int()'s digits
def test_a_state_key_of_other_digits_is_refused_not_read_as_an_id(key: str) -> None:
    _, saved = _adam()
    saved["state"][key] = {"step": torch.tensor(1.0)}
    assert normalize_optimizer_state(saved) is saved and unfit_state_keys(saved) == [key]
    with pytest.raises(OptimizerStateMismatchError, match="1 optimizer state entry fits no parameter"):
        check_state_keys(saved, "ckpt.pt")
    only_digits = {"state": {key: {}}, "param_groups": [{"params": [0]}]}
    assert normalize_optimizer_state(only_digits) is only_digits  # int() raised ValueError here
