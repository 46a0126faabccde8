"""A long-lived fuzz worker: runs one (file, read path) case at a time and reports how it ended."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import resource
import sys
import traceback
import warnings
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, cast

PATHS = (
    "load_checkpoint",
    "inspect_checkpoint",
    "resume",
    "convert_checkpoint",
    "verify_archive",
    "cli inspect",
    "cli verify",
    "cli convert",
)
PT_PATHS = (  # a torch file to the other formats
    "convert_checkpoint safetensors",
    "convert_checkpoint dcp",
    "cli convert safetensors",
    "cli convert dcp",
)
INIT_FROM = "manager resume init_from"
FOLDER_PATHS = ("resume folder", "latest_checkpoint", "cli list", "manager resume")
FOREIGN_FOLDER_PATHS = ("cli list",)
RESTORE_PATHS = ("resume", "resume folder", "manager resume", INIT_FROM)  # checked for half-restores


def paths_for(corpus: str, source: Path) -> tuple[str, ...]:
    """The read paths a case of corpus item ``corpus`` (lying at ``source``) goes through."""
    if corpus == "manager":
        return FOLDER_PATHS
    if source.is_dir():
        return (*PATHS, *FOREIGN_FOLDER_PATHS, INIT_FROM)
    if source.suffix == ".safetensors":
        return (*PATHS, INIT_FROM)
    return (*PATHS, *PT_PATHS, INIT_FROM)


AS_HEADROOM = 4 << 30  # address space a case may add before allocation fails (protects the machine)


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    return 0


def _where(tb: Any) -> tuple[str, str]:
    """(deepest frame, deepest frame inside dist_resume) as ``module:function:line``."""
    frames = traceback.extract_tb(tb)
    deepest = ours = ""
    for frame in frames:
        name = f"{_module(frame.filename)}:{frame.name}:{frame.lineno}"
        deepest = name
        if "/dist_resume/" in frame.filename:
            ours = name
    return deepest, ours


def _module(filename: str) -> str:
    parts = Path(filename).with_suffix("").parts
    for root in ("dist_resume", "torch"):
        if root in parts:
            return ".".join(parts[len(parts) - 1 - parts[::-1].index(root) :])
    return Path(filename).stem


def _cli_escape(stderr: str) -> tuple[str, str, str, str]:
    """(type, message, deepest frame, deepest dist_resume frame) from the traceback the CLI printed."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', stderr)
    deepest = ours = ""
    for filename, lineno, func in frames:
        name = f"{_module(filename)}:{func}:{lineno}"
        deepest = name
        if "/dist_resume/" in filename:
            ours = name
    kind = message = ""
    skip = ("Traceback", "dist-resume", "During handling", "The above exception")
    for ln in reversed(lines):
        if not ln[:1].isspace() and not ln.startswith(skip) and re.match(r"^[A-Za-z_][\w.]*(:|$)", ln):
            kind, _, message = ln.partition(": ")
            break
    return kind.strip() or "unknown", message.strip(), deepest, ours


def _failed_allocation(err: BaseException) -> bool:
    """Whether ``err`` or an exception it was raised from is a failed allocation (RLIMIT_AS hit)."""
    seen: BaseException | None = err
    for _ in range(10):
        if seen is None:
            return False
        text = str(seen)
        if isinstance(seen, MemoryError) or "can't allocate memory" in text or "out of memory" in text:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


_CHANGED: list[str] = []  # what a failed resume of the current case left changed (a half-restore)


def _fingerprint(objs: dict[str, Any]) -> dict[str, Any]:
    """Copies of everything a resume may change: each object's state dict, the RNG streams."""
    import copy
    import random

    import numpy as np
    import torch

    out: dict[str, Any] = {name: copy.deepcopy(obj.state_dict()) for name, obj in objs.items()}
    out["optimizer tensors"] = (
        [id(t) for s in objs["optimizer"].state.values() for t in s.values()] if "optimizer" in objs else []
    )
    out["rng"] = (torch.get_rng_state(), random.getstate(), cast(tuple[Any, ...], np.random.get_state())[1].copy())
    return out


def _differs(a: Any, b: Any) -> bool:
    import numpy as np
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return not (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, np.ndarray):
        return not (isinstance(b, np.ndarray) and np.array_equal(a, b))
    if isinstance(a, dict):
        return not isinstance(b, dict) or a.keys() != b.keys() or any(_differs(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return not isinstance(b, (list, tuple)) or len(a) != len(b) or any(map(_differs, a, b))
    return bool(a != b)


def _all_or_nothing(objs: dict[str, Any], resume: Any) -> None:
    """``resume()``; when it raises, note in ``_CHANGED`` every part that is not as it was before."""
    before = _fingerprint(objs)
    try:
        resume()
    except BaseException:
        after = _fingerprint(objs)
        _CHANGED.extend(k for k in before if _differs(before[k], after[k]))
        raise


def run_case(path_kind: str, target: Path, original: Path, scratch: Path, corpus: str) -> dict[str, Any]:
    import torch

    import dist_resume as dr
    from dist_resume.cli import main as cli_main

    sys.path.insert(0, str(Path(__file__).parent))
    from _fuzz_corpus import RESTORES, trained

    def objects() -> dict[str, Any]:
        model, opt, sched, scaler = trained()
        every = {"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler}
        return {name: every[name] for name in RESTORES[corpus]}

    out = scratch / "out.pt"
    if path_kind == "load_checkpoint":
        dr.load_checkpoint(target, map_location="cpu")
    elif path_kind == "inspect_checkpoint":
        dr.tools.inspect_checkpoint(target)
    elif path_kind in ("resume", "resume folder"):
        objs = objects()
        _all_or_nothing(objs, lambda: dr.resume(target, **objs, options=dr.ResumeOptions(map_location="cpu")))
    elif path_kind == "latest_checkpoint":
        dr.tools.latest_checkpoint(target)
    elif path_kind == "convert_checkpoint":
        dr.tools.convert_checkpoint(target, out, dr.tools.KeyForm.DDP, force=True)
    elif path_kind == "convert_checkpoint safetensors":
        dr.tools.convert_checkpoint(target, scratch / "out.safetensors", format="safetensors", force=True)
    elif path_kind == "convert_checkpoint dcp":
        dr.tools.convert_checkpoint(target, scratch / "out_dcp", dr.tools.KeyForm.SINGLE, format="dcp", force=True)
    elif path_kind == "manager resume":
        with dr.CheckpointManager(target) as mgr:
            objs = objects()
            _all_or_nothing(objs, lambda: mgr.resume(**objs, options=dr.ResumeOptions(map_location="cpu")))
    elif path_kind == INIT_FROM:
        with dr.CheckpointManager(scratch / "run") as mgr:
            wanted = {k: v for k, v in objects().items() if k in ("model", "optimizer")}
            options = dr.ResumeOptions(map_location="cpu")
            resumed: list[Any] = []
            _all_or_nothing(wanted, lambda: resumed.append(mgr.resume(init_from=target, **wanted, options=options)))
            if resumed[0] is None:
                raise RuntimeError("CheckpointManager.resume(init_from=...) started fresh")
    elif path_kind == "verify_archive":
        dr.tools.verify_archive(target)
    else:
        argv = {
            "cli inspect": ["inspect", str(target)],
            "cli verify": ["verify", str(original), str(target)],
            "cli convert": ["convert", str(target), str(out), "--to", "ddp", "--force"],
            "cli convert safetensors": [
                "convert",
                str(target),
                str(scratch / "o.safetensors"),
                "--format",
                "safetensors",
            ],
            "cli convert dcp": ["convert", str(target), str(scratch / "o_dcp"), "--format", "dcp", "--force"],
            "cli list": ["list", str(target), "--verify"],
        }[path_kind]
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            rc = cli_main(argv)
        if rc == 4:
            kind, message, where, ours = _cli_escape(stderr.getvalue())
            return {"outcome": "escape", "type": kind, "message": message, "where": where, "ours": ours, "rc": rc}
        return {"outcome": "success" if rc in (0, 1) else "refused", "rc": rc}
    del torch
    return {"outcome": "success"}


def worker_main(conn: Connection) -> None:
    """Serve cases until the parent closes the pipe."""
    import torch

    import dist_resume as dr

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    logging.getLogger("dist_resume").setLevel(logging.CRITICAL)
    logging.getLogger("dist_resume").propagate = False
    with open("/proc/self/statm") as f:
        vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_AS, (vm + AS_HEADROOM, resource.RLIM_INFINITY))
    conn.send({"ready": os.getpid()})
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        scratch = Path(job["scratch"])
        _CHANGED.clear()
        start_rss = _rss_kib()
        before_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            result = run_case(job["path"], Path(job["target"]), Path(job["original"]), scratch, job["corpus"])
        except dr.DistResumeError as err:
            result = {"outcome": "refused", "type": type(err).__name__}
            if _failed_allocation(err):  # refused, but only after trying to allocate past the limit
                result = {"outcome": "memory", "type": type(err).__name__, "message": str(err)[:300]}
        except MemoryError as err:
            result = {"outcome": "memory", "type": "MemoryError", "message": str(err)[:300]}
        except Exception as err:
            deepest, ours = _where(err.__traceback__)
            message = str(err).splitlines()[0][:300] if str(err) else ""
            outcome = "memory" if "can't allocate memory" in message or "out of memory" in message else "escape"
            result = {
                "outcome": outcome,
                "type": f"{type(err).__module__}.{type(err).__qualname__}".removeprefix("builtins."),
                "message": message,
                "where": deepest,
                "ours": ours,
                "traceback": "".join(traceback.format_exception(err)[-6:])[-2000:],
            }
        if _CHANGED and result["outcome"] in ("refused", "escape"):
            kind = result.get("type", "")
            result = {**result, "outcome": "half-restore", "message": f"{kind} left changed: {', '.join(_CHANGED)}"}
        after_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        result["peak_kib"] = max(0, after_peak - start_rss) if after_peak > before_peak else 0
        result["raised_peak_kib"] = after_peak - before_peak
        result["id"] = job["id"]
        conn.send(result)
