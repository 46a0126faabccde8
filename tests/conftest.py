"""Shared fixtures. Markers (cuda, multigpu, dist) are declared in pyproject.toml."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests import accelerator as sim
from tests.helpers import DESELECTED, TORCHRUN_VARS, save_with_device_tag

REPO_ROOT = Path(__file__).resolve().parents[1]


def pytest_deselected(items: list[pytest.Item]) -> None:
    """Keep what ``-m``/``-k`` left out, so that tests/test_docs.py can count the whole suite (the ``slow`` tests)."""
    if items:
        items[0].config.stash.setdefault(DESELECTED, []).extend(items)


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


SIM_DEVICES = 2  # the accelerator fixture's sim devices: sim:0 and sim:1


@pytest.fixture(params=sim.accelerator_params())
def accelerator(request: pytest.FixtureRequest) -> Iterator[sim.Accel]:
    """One test body, two accelerators: the test accelerator (``sim``, 2 devices, every CI run; built on first use,
    skipped with the reason where it cannot be built) and CUDA (marked ``cuda``: the multi-GPU job; a test that needs
    two devices says ``@on_accelerators(2)``, which marks its CUDA variant ``multigpu`` too). For sim the devices are
    on for this test only: afterwards ``torch.accelerator.is_available()`` is False again."""
    if request.param == "cuda":
        yield sim.Accel("cuda", torch.accelerator.device_count())
        return
    yield from _sim_devices()


@pytest.fixture
def sim_accelerator() -> Iterator[sim.Accel]:
    """The test accelerator alone, on for this test as in ``accelerator``: for what only a PrivateUse1 backend has
    (a process-group backend its plugin registers for the device type). Skipped where it cannot be built."""
    yield from _sim_devices()


def _sim_devices() -> Iterator[sim.Accel]:
    reason = sim.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with sim.enabled(SIM_DEVICES):
        yield sim.Accel("sim", SIM_DEVICES)


@pytest.fixture(scope="session")
def sim_worker_env() -> dict[str, str]:
    """Environment for a sub-process on the test accelerator (a torchrun worker calling
    ``tests.accelerator.worker_boot.boot()``): ``DIST_RESUME_SIM_LIB``, ``DIST_RESUME_SIM_DEVICES``, ``PYTHONPATH``.
    Builds the library on first use; skips where it cannot be built."""
    reason = sim.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    return sim.worker_env(SIM_DEVICES)
