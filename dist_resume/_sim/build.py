"""Build the test accelerator's C++ library once, cached by content, safe under pytest-xdist.

The library is ``sim_backend.cpp`` (shipped with the package) compiled by ``torch.utils.cpp_extension.load`` (ninja,
one translation unit; ``pip install "dist-resume[sim]"`` installs ninja) into ``<cache>/<key>/``: the cache is
``$DIST_RESUME_SIM_CACHE``, else ``$XDG_CACHE_HOME/dist_resume/sim`` (``~/.cache/dist_resume/sim``); this
repository's tests point it at ``tests/accelerator/.build`` (git-ignored). ``<key>`` hashes the source, the torch
build, the Python version and the compiler flags, so a changed source or a new torch builds afresh and an unchanged
one is reused without running ninja. Concurrent callers (xdist workers, torchrun ranks) serialise on a file lock:
one builds, the others wait and then reuse its result.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from .._core.errors import SimBuildError
from .._dist.accelerator import current_accelerator

__all__ = [
    "LIB_ENV",
    "CACHE_ENV",
    "SimBuildError",
    "build",
    "build_seconds",
    "built_library",
    "cache_root",
    "library_path",
    "toolchain_missing",
    "unavailable_reason",
]

LIB_ENV = "DIST_RESUME_SIM_LIB"  # a built library's path, handed to sub-processes so they skip even the hash
CACHE_ENV = "DIST_RESUME_SIM_CACHE"  # where builds are kept (one folder per key)
SOURCE = Path(__file__).with_name("sim_backend.cpp")
CFLAGS = ("-O1",)  # -O0 builds no faster here (the time goes to parsing torch's headers); -O1 runs the kernels faster
BUILD_TIMEOUT_S = 600.0

_BUILD_SCRIPT = """
import sys
from torch.utils.cpp_extension import load
load(name=sys.argv[1], sources=[sys.argv[2]], build_directory=sys.argv[3], extra_cflags=sys.argv[4:],
     is_python_module=False, verbose=True)
"""


def _key() -> str:
    digest = hashlib.sha256(SOURCE.read_bytes())
    for part in (str(torch.__version__), str(torch.version.git_version), sys.version.split()[0], *CFLAGS):
        digest.update(b"\0" + part.encode())
    return digest.hexdigest()[:16]


def cache_root() -> Path:
    """The folder that holds the builds: ``$DIST_RESUME_SIM_CACHE``, else ``$XDG_CACHE_HOME/dist_resume/sim``."""
    given = os.environ.get(CACHE_ENV)
    if given:
        return Path(given)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "dist_resume" / "sim"


def library_path() -> Path:
    """Where the library for the current source and torch lives (it may not be built yet)."""
    key = _key()
    return cache_root() / key / f"sim_backend_{key}.so"


def built_library() -> Path | None:
    """The library already built for this process: ``$DIST_RESUME_SIM_LIB`` or the cache's, else None."""
    given = os.environ.get(LIB_ENV)
    if given and Path(given).is_file():
        return Path(given)
    return library_path() if library_path().is_file() else None


def unavailable_reason() -> str | None:
    """Why the test accelerator cannot be built or used here, or None when it can. Local."""
    found = current_accelerator()
    if found is not None and found.type != "sim":
        return (
            f"{found.describe()} in this process: a PrivateUse1 backend would take torch.accelerator over from "
            f"{found.type}, so the test accelerator stays off here (use the {found.type} devices instead)"
        )
    if built_library() is not None:
        return None  # built already (by a parent process, or earlier)
    return toolchain_missing()


def toolchain_missing() -> str | None:
    """What of the build toolchain (ninja, a C++ compiler) is missing, or None."""
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        return 'ninja is not installed: cannot build the test accelerator; pip install "dist-resume[sim]" (or ninja)'
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return (
            f"no C++ compiler ({compiler!r}, from $CXX or the default c++) on PATH: cannot build the test accelerator"
        )
    return None


def _locked_build(target: Path) -> None:
    build_dir = target.parent
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir.parent / f"{build_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if target.is_file():  # another process built it while this one waited
            return
        (build_dir / "lock").unlink(missing_ok=True)  # cpp_extension's own baton, left behind by a killed build
        name = target.stem
        cmd = [sys.executable, "-c", _BUILD_SCRIPT, name, str(SOURCE), str(build_dir), *CFLAGS]
        bin_dir = str(Path(sys.executable).parent)  # ninja installed in this environment
        env = {**os.environ, "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")])}
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, env=env)
        except subprocess.TimeoutExpired as err:
            raise SimBuildError(
                f"building the test accelerator took over {BUILD_TIMEOUT_S:g}s and was stopped; build it on a less busy "
                "machine, or point $DIST_RESUME_SIM_LIB at a library built there"
            ) from err
        if done.returncode != 0 or not target.is_file():
            output = (done.stdout + done.stderr)[-6000:]
            raise SimBuildError(
                f"building the test accelerator failed (exit {done.returncode}); the C++ compiler ($CXX or c++) must "
                f"build against this torch's headers. Its output:\n{output}"
            )


_built: Path | None = None
_failed: SimBuildError | None = None


def build() -> Path:
    """Build the library (or reuse the one built for this source and torch) and return its path.

    Cheap when it exists (a hash of one source file, no ninja, no lock). Raises ``SimBuildError`` with the compiler's
    output on failure, and the same error again on later calls in this process instead of rebuilding.
    """
    global _built, _failed
    if _built is not None:
        return _built
    if _failed is not None:
        raise _failed
    given = os.environ.get(LIB_ENV)
    if given and Path(given).is_file():
        _built = Path(given)
        return _built
    target = library_path()
    if not target.is_file():
        start = time.monotonic()
        try:
            _locked_build(target)
        except SimBuildError as err:
            _failed = err
            raise
        build_seconds[target.name] = time.monotonic() - start
    _built = target
    return target


build_seconds: dict[str, float] = {}  # wall time of builds done (or waited for) by this process, for reports
