"""Shared fixtures. Markers (cuda, multigpu, dist) are declared in pyproject.toml."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dist_resume.cli import main
from tests import accelerator as sim
from tests.helpers import DESELECTED, TORCHRUN_VARS, save_with_device_tag

REPO_ROOT = Path(__file__).resolve().parents[1]


def pytest_deselected(items: list[pytest.Item]) -> None:
    """Keep what ``-m``/``-k`` left out, so that tests/test_docs.py can count the whole suite (the ``slow`` tests)."""
    if items:
        items[0].config.stash.setdefault(DESELECTED, []).extend(items)


def pytest_sessionstart(session: pytest.Session) -> None:
    _dataloader_workers_unmeasured()


def _dataloader_workers_unmeasured() -> None:
    """Under coverage (.ci/run), a DataLoader's worker processes run without it; other multiprocessing children (the
    harness's ranks) are measured as before. Starting coverage in each worker and saving its data at exit made the
    loader tests 2.5x slower (tests/test_exact_loaders.py, test_worker_streams.py and test_stateful_loader.py: 55 s
    against 22 s unmeasured, 408 data files) for what the workers run of dist_resume: the ``worker_init_fn`` of
    ``WorkerStreams``, which tests/test_worker_streams.py also calls in-process."""
    import multiprocessing.process

    try:
        from coverage import multiproc
    except ImportError:
        return
    measured = multiprocessing.process.BaseProcess._bootstrap  # type: ignore[attr-defined]
    unmeasured = getattr(multiproc, "original_bootstrap", measured)
    if measured is unmeasured:  # no coverage, or coverage without its multiprocessing patch
        return
    loops = {torch.utils.data._utils.worker._worker_loop}
    try:
        from torchdata.stateful_dataloader import worker as stateful_worker
    except ImportError:
        pass
    else:
        loops.add(stateful_worker._worker_loop)

    def _bootstrap(self: multiprocessing.process.BaseProcess, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "_target", None) not in loops:
            return measured(self, *args, **kwargs)
        sys.settrace(None)  # the tracer a forked worker inherits from its parent
        threading.settrace(None)  # type: ignore[arg-type]
        return unmeasured(self, *args, **kwargs)

    multiprocessing.process.BaseProcess._bootstrap = _bootstrap  # type: ignore[attr-defined]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The end-to-end launches first, where a run selects them (.ci/run): the longest tests start while the short ones
    are left to fill the gaps between them, on every xdist worker (each sorts the same collection the same way)."""
    items.sort(key=lambda item: item.get_closest_marker("e2e") is None)


@pytest.fixture(autouse=True)
def _e2e_launches_unmeasured(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under coverage (.ci/run), the processes an ``e2e`` test launches (torchrun, whole scripts, their workers) run
    without it: coverage's subprocess patch measures a child Python that finds ``COVERAGE_PROCESS_CONFIG`` in its
    environment, and the launches copy the test's. Measured, the e2e set took 8 min 20 s instead of 6 min 47 s for half a
    point of coverage; the test's own process is still measured (``check_resume`` runs there)."""
    if request.node.get_closest_marker("e2e") is not None:
        monkeypatch.delenv("COVERAGE_PROCESS_CONFIG", raising=False)


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


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A real S3-protocol HTTP server on 127.0.0.1 for this test session (moto's server mode, as s3fs's own tests use;
    FACTS 38), on a port the kernel picks when it binds. ``AWS_ENDPOINT_URL`` and dummy credentials point s3fs at it,
    in this process and in every process a test launches; all of it is undone at the end of the session."""
    moto_server = pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    import logging

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    werkzeug = logging.getLogger("werkzeug")  # one log line per request otherwise
    level = werkzeug.level
    werkzeug.setLevel(logging.ERROR)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    try:
        with pytest.MonkeyPatch.context() as mp:
            for name, value in {
                "AWS_ENDPOINT_URL": endpoint,
                "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1",
            }.items():
                mp.setenv(name, value)
            mp.delenv("AWS_PROFILE", raising=False)
            yield endpoint
    finally:
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()  # no instance keeps pointing at the stopped server
        server.stop()
        werkzeug.setLevel(level)


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> Iterator[str]:
    """``s3://<a new bucket>`` on the session's S3 server, deleted with everything in it afterwards."""
    import uuid

    import fsspec

    fs = fsspec.filesystem("s3")
    name = f"dr-{uuid.uuid4().hex[:16]}"
    fs.mkdir(name)
    yield f"s3://{name}"
    fs.invalidate_cache()
    fs.rm(name, recursive=True)


@pytest.fixture
def mem() -> Iterator[str]:
    """A fresh ``memory://`` prefix (fsspec's in-process store), emptied afterwards."""
    import uuid

    fsspec = pytest.importorskip("fsspec")
    url = f"memory://t-{uuid.uuid4().hex[:12]}"
    yield url
    fs = fsspec.filesystem("memory")
    if fs.exists(url):
        fs.rm(url, recursive=True)


@pytest.fixture
def run(capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str, str]]:
    """The ``dist-resume`` command in this process: ``run(*args)`` gives (exit status, stdout, stderr)."""

    def _run(*args: Any) -> tuple[int, str, str]:
        code = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return code, out, err

    return _run
