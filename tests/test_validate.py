"""check_scaler: a GradScaler state is checked in full before GradScaler.load_state_dict sees it."""

from __future__ import annotations

import pytest
import torch

from dist_resume._state.validate import check_scaler
from dist_resume.errors import StateMismatchError


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
