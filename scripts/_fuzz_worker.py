"""A long-lived fuzz worker: runs one (file, read path) case at a time and reports how it ended."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import resource
import sys
import time
import traceback
import warnings
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from _fuzz_half_restore import CHANGED, all_or_nothing

PATHS = (
    "load_checkpoint",
    "inspect_checkpoint",
    "resume",
    "resume default",
    "resume lenient",
    "convert_checkpoint",
    "verify_archive",
    "cli inspect",
    "cli inspect --json",
    "cli verify",
    "cli verify --json",
    "cli convert",
)
PT_PATHS = (  # a torch file to the other formats
    "convert_checkpoint safetensors",
    "convert_checkpoint dcp",
    "convert_checkpoint sharded",
    "cli convert safetensors",
    "cli convert dcp",
    "cli convert sharded",
)
INIT_FROM = "manager resume init_from"
FOLDER_PATHS = ("resume folder", "latest_checkpoint", "cli list", "cli list --json", "manager resume")
FOREIGN_FOLDER_PATHS = ("cli list", "cli list --json")
# a run of sharded checkpoints: the folder's paths, and its newest ckpt_<step>.dcp/ through inspect, verify, convert
SHARDED_RUN_PATHS = (*FOLDER_PATHS, "cli inspect newest", "cli verify newest", "cli convert newest")
# every resume: after one that raised, the worker compares each live object and the RNG streams with before
RESTORE_PATHS = ("resume", "resume default", "resume lenient", "resume folder", "manager resume", INIT_FROM)


def paths_for(corpus: str, source: Path) -> tuple[str, ...]:
    """The read paths a case of corpus item ``corpus`` (lying at ``source``) goes through."""
    if corpus == "manager":
        return FOLDER_PATHS
    if corpus == "sharded_run":
        return SHARDED_RUN_PATHS
    if source.is_dir():
        return (*PATHS, *FOREIGN_FOLDER_PATHS, INIT_FROM)
    if source.suffix == ".safetensors":
        return (*PATHS, INIT_FROM)
    return (*PATHS, *PT_PATHS, INIT_FROM)


LIVE_SEED = 5  # the live objects a resume restores into: not the ones the corpus was saved from (seed 0)
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


def _resume_options(path_kind: str) -> Any:
    """The ResumeOptions a resume path passes: the CPU (``map_location``), none (the default: the file
    memory-mapped and copied into the live tensors) or the lenient ones (strict=False, every part optional, the
    live optimizer's hyperparameters)."""
    import dist_resume as dr

    if path_kind.endswith(" default") or path_kind == "manager resume":
        return None
    if path_kind.endswith(" lenient"):
        return dr.ResumeOptions(strict=False, allow_missing="all", optimizer_hparams="current")
    return dr.ResumeOptions(map_location="cpu")


def _cli_argv(path_kind: str, target: Path, original: Path, scratch: Path) -> list[str]:
    out = str(scratch / "out.pt")
    if path_kind.endswith(" newest"):  # the newest checkpoint of a run folder, compared with the unmutated one
        newest = sorted(p.name for p in original.iterdir() if p.name.startswith("ckpt_"))[-1]
        target, original, path_kind = target / newest, original / newest, path_kind.removesuffix(" newest")
    return {
        "cli inspect": ["inspect", str(target)],
        "cli inspect --json": ["inspect", str(target), "--json"],
        "cli verify": ["verify", str(original), str(target)],
        "cli verify --json": ["verify", str(target), str(original), "--json"],
        "cli convert": ["convert", str(target), out, "--to", "ddp", "--force"],
        "cli convert safetensors": ["convert", str(target), str(scratch / "o.safetensors"), "--format", "safetensors"],
        "cli convert dcp": ["convert", str(target), str(scratch / "o_dcp"), "--format", "dcp", "--force"],
        "cli convert sharded": [
            "convert", str(target), str(scratch / "ckpt_3.dcp"), "--format", "sharded", "--to", "single", "--check-crc"
        ],
        "cli list": ["list", str(target), "--verify"],
        "cli list --json": ["list", str(target), "--json"],
    }[path_kind]  # fmt: skip


def run_case(path_kind: str, target: Path, original: Path, scratch: Path, corpus: str) -> dict[str, Any]:
    import dist_resume as dr
    from dist_resume.cli import main as cli_main

    sys.path.insert(0, str(Path(__file__).parent))
    from _fuzz_corpus import ADAMW_ITEMS, RESTORES, averaged, trained

    def objects(every_part: bool = False) -> dict[str, Any]:
        kind = "adamw" if corpus in ADAMW_ITEMS else "sgd"
        model, opt, sched, scaler = trained(seed=LIVE_SEED, steps=3, optimizer=kind)  # every state unlike the file's
        every = {"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler, "ema": averaged(model, 3)}
        return every if every_part else {name: every[name] for name in RESTORES[corpus]}

    convert = dr.tools.convert_checkpoint
    if path_kind == "load_checkpoint":
        dr.load_checkpoint(target, map_location="cpu")
    elif path_kind == "inspect_checkpoint":
        dr.tools.inspect_checkpoint(target)
    elif path_kind.startswith(("resume", "manager resume")) and path_kind != INIT_FROM:
        objs = objects(every_part=path_kind.endswith(" lenient"))
        options = _resume_options(path_kind)
        if path_kind == "manager resume":
            with dr.CheckpointManager(target) as mgr:
                all_or_nothing(objs, lambda: mgr.resume(**objs, options=options))
        else:
            all_or_nothing(objs, lambda: dr.resume(target, **objs, options=options))
    elif path_kind == "latest_checkpoint":
        dr.tools.latest_checkpoint(target)
    elif path_kind == "convert_checkpoint":
        convert(target, scratch / "out.pt", dr.tools.KeyForm.DDP, force=True)
    elif path_kind == "convert_checkpoint safetensors":
        convert(target, scratch / "out.safetensors", format="safetensors", force=True)
    elif path_kind == "convert_checkpoint dcp":
        convert(target, scratch / "out_dcp", dr.tools.KeyForm.SINGLE, format="dcp", force=True)
    elif path_kind == "convert_checkpoint sharded":
        convert(target, scratch / "ckpt_5.dcp", format="sharded", force=True)
    elif path_kind == INIT_FROM:
        with dr.CheckpointManager(scratch / "run") as mgr:
            wanted = {k: v for k, v in objects().items() if k in ("model", "optimizer", "ema")}
            options = dr.ResumeOptions(map_location="cpu")
            resumed: list[Any] = []
            all_or_nothing(wanted, lambda: resumed.append(mgr.resume(init_from=target, **wanted, options=options)))
            if resumed[0] is None:
                raise RuntimeError("CheckpointManager.resume(init_from=...) started fresh")
    elif path_kind == "verify_archive":
        dr.tools.verify_archive(target)
    else:
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            rc = cli_main(_cli_argv(path_kind, target, original, scratch))
        if rc == 4:
            kind, message, where, ours = _cli_escape(stderr.getvalue())
            return {"outcome": "escape", "type": kind, "message": message, "where": where, "ours": ours, "rc": rc}
        return {"outcome": "success" if rc in (0, 1) else "refused", "rc": rc}
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
        CHANGED.clear()
        start_rss, started = _rss_kib(), time.perf_counter()
        before_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            result = run_case(job["path"], Path(job["target"]), Path(job["original"]), scratch, job["corpus"])
        except dr.DistResumeError as err:
            result = {"outcome": "refused", "type": type(err).__name__}
            if isinstance(err, dr.errors.RestoreError):  # the plan passed it: a part's own load refused it
                cause = err.__cause__ or err
                deepest, ours = _where(cause.__traceback__)
                message = f"{type(cause).__name__}: {str(cause).splitlines()[0][:250] if str(cause) else ''}"
                result = {"outcome": "late", "type": "RestoreError", "message": message, "where": deepest, "ours": ours}
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
        if CHANGED and result["outcome"] in ("refused", "escape", "late"):
            kind = result.get("type", "")
            result = {**result, "outcome": "half-restore", "message": f"{kind} left changed: {', '.join(CHANGED)}"}
        after_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        result["peak_kib"] = max(0, after_peak - start_rss) if after_peak > before_peak else 0
        result["raised_peak_kib"] = after_peak - before_peak
        result["seconds"] = round(time.perf_counter() - started, 4)
        result["id"] = job["id"]
        conn.send(result)
