"""Shared fixtures. Markers (cuda, multigpu, dist) are declared in pyproject.toml."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers import TORCHRUN_VARS, save_with_device_tag

REPO_ROOT = Path(__file__).resolve().parents[1]


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("cuda") and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if item.get_closest_marker("multigpu") and torch.cuda.device_count() < 2:
        pytest.skip(f"needs at least 2 CUDA GPUs, found {torch.cuda.device_count()}")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The repository root (the directory holding pyproject.toml)."""
    return REPO_ROOT


@pytest.fixture
def cuda_tagged_save() -> Callable[..., None]:
    """``save_with_device_tag(obj, path, tag="cuda:3")``: torch.save as if the CPU tensors lived on ``tag``."""
    return save_with_device_tag


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [f"torch {torch.__version__}, cuda available: {torch.cuda.is_available()}"]


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """A clean torchrun-free environment; ``env(RANK=1, ...)`` sets variables for this test only."""
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    assert not dist.is_initialized()

    def set_vars(**values: object) -> None:
        for name, value in values.items():
            monkeypatch.setenv(name, str(value))

    return set_vars
