"""The ``dist-resume`` argument parser: subcommands, their options, and the exit statuses they document."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from .._core.errors import UsageError
from .._core.location import Location
from .._core.version import __version__
from .._store.url import location
from ._commands import cmd_check, cmd_convert, cmd_env, cmd_inspect, cmd_list, cmd_verify

__all__ = ["PROG", "EPILOG", "build_parser"]

PROG = "dist-resume"
EPILOG = """\
exit status:
  0  success (verify: the checkpoints are equal; check: the resume is exact)
  1  verify: the checkpoints differ; check: the resume is not exact (the differences are listed)
  2  usage or input error: bad arguments; a missing, empty, truncated, damaged, unsafe or
     unrecognised checkpoint; SRC == DST; DST exists without --force; inconsistent torchrun variables;
     check: COMMAND without {dir}, failing on its own, writing no checkpoint, or past --timeout
  3  the output could not be written (permissions, disk full, missing folder); DST is untouched
  4  internal error (a bug: please report it with the traceback)
  130 interrupted

dist-resume reads only what torch.load(weights_only=True) accepts and never runs code from a file.
Every CKPT, SRC, DST, A, B and DIR may be a URL (s3://bucket/run/ckpt_00000100.pt, gs://, az://, any fsspec
protocol with its package installed: pip install "dist_resume[s3]"); credentials come from the environment.
--json output carries a "schema" field ("dist-resume/<command>/1") that changes only with the format.
"""


def _location(text: str) -> Location:
    """A path or a URL (``s3://bucket/run``): a URL is never taken for a local path (argparse's ``type=``)."""
    try:
        return location(text)
    except UsageError as err:
        raise argparse.ArgumentTypeError(f"{err}; {err.hint}" if err.hint else str(err)) from err


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``dist-resume``."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect, convert and compare PyTorch checkpoints; show what torchrun set; check that a training "
        "command resumes exactly.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors (and --json output)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(
        name: str, func: Callable[[argparse.Namespace], int], help_: str, json_help: str | None
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(
            name,
            parents=[common],
            help=help_,
            description=help_,
            epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        if json_help:
            p.add_argument("--json", action="store_true", help=json_help)
        p.set_defaults(func=func)
        return p

    p = add(
        "inspect",
        cmd_inspect,
        "what a checkpoint holds: layout, which key each part came from, prefixes, tensors per dtype, "
        "device tags, optimizer and its hyper-parameters, metadata, warnings (reads no tensor data)",
        "print the report as JSON (schema dist-resume/inspect/1)",
    )
    p.add_argument("checkpoint", type=_location, metavar="CKPT")
    p.add_argument(
        "--part",
        action="append",
        metavar="PART=KEY",
        help="take PART (model, optimizer, scheduler, scaler, ema, epoch, step) from KEY ('outer.inner' one "
        "level down) instead of detecting it; repeatable",
    )
    p = add(
        "convert",
        cmd_convert,
        "re-key model keys and optimizer param_names for a single-process or a DDP model, and/or write "
        "another format (.pt, .safetensors, DCP folder, sharded checkpoint folder); .pt <-> .safetensors copies "
        "tensor bytes as they are",
        "print a JSON summary (schema dist-resume/convert/1)",
    )
    p.add_argument("src", type=_location, metavar="SRC", help="a .pt/.ckpt/.safetensors file or a checkpoint folder")
    p.add_argument("dst", type=_location, metavar="DST", nargs="?", help="the file or folder to write (or --into)")
    p.add_argument(
        "--into",
        type=_location,
        metavar="FOLDER",
        help="instead of DST: write SRC into the CheckpointManager folder FOLDER as its checkpoint of SRC's step "
        "(FOLDER/ckpt_<step>.pt, the manager's format), so that CheckpointManager(FOLDER).resume() continues "
        "that run at that step; refused if FOLDER holds a later checkpoint, or one of that step without --force",
    )
    p.add_argument(
        "--step",
        type=int,
        metavar="N",
        help="with --into: the step to write the checkpoint at, instead of the one SRC records (needed when SRC "
        "records neither a step nor an epoch)",
    )
    p.add_argument(
        "--steps-per-epoch",
        type=int,
        metavar="K",
        help="with --into, for a SRC that records an epoch but no step (torchvision's and timm's checkpoint.pth): "
        "the step is the epochs before the one the run continues in times K (without it: 0, the epoch set)",
    )
    p.add_argument(
        "--to",
        choices=["ddp", "single"],
        help="ddp: keys as DistributedDataParallel/DataParallel expect ('module.' added); "
        "single: keys of the plain model ('module.'/'_orig_mod.' removed in every nesting)",
    )
    p.add_argument(
        "--format",
        choices=["pt", "safetensors", "dcp", "sharded"],
        help="pt (default): a torch zip file (a .pt source keeps its layout; others become dist_resume files; "
        "a sharded checkpoint folder becomes the file a DDP save writes); "
        "safetensors: model weights only, plain keys unless --to ddp; dcp: a torch.distributed.checkpoint "
        "folder {'model', 'optim'} keyed by FQN, for dcp.load/set_state_dict; sharded: the folder an FSDP2 "
        "model saves (ckpt_<step>.dcp/), loadable at any world size",
    )
    p.add_argument(
        "--part",
        action="append",
        default=[],
        metavar="PART=KEY",
        help="which entry holds a part, where detection should not decide (e.g. model=MODEL_STATE, "
        "optimizer=state.opt); repeatable",
    )
    p.add_argument(
        "--force", action="store_true", help="replace DST if it exists (--into: a checkpoint of the same step)"
    )
    p.add_argument(
        "--check-crc",
        action="store_true",
        help="check the CRC32 of every record of SRC first (reads the whole file once more)",
    )
    p = add(
        "verify",
        cmd_verify,
        "compare the parts detected in two checkpoints (model weights under canonical keys; optimizer, "
        "epoch, step, scheduler, GradScaler where both have them): keys, shapes, dtypes, bitwise values; "
        "exit 0 equal, 1 different",
        "print the report as JSON (schema dist-resume/verify/1)",
    )
    p.add_argument("a", type=_location, metavar="A")
    p.add_argument("b", type=_location, metavar="B")
    p.add_argument(
        "--part",
        action="append",
        metavar="PART=KEY",
        help="take PART from KEY in whichever file holds KEY, instead of detecting it; repeatable",
    )
    p = add(
        "list",
        cmd_list,
        "a checkpoint folder's checkpoints (step, epoch, size, age, world size, valid or damaged and why), "
        "temporary files left by killed saves, and the one resume would pick; also an HF Trainer output folder",
        "print the report as JSON (schema dist-resume/list/1)",
    )
    p.add_argument("folder", type=_location, metavar="DIR")
    p.add_argument("--verify", action="store_true", help="check the CRC32 of every record (reads every file once)")
    p = add(
        "check",
        cmd_check,
        "does COMMAND resume exactly? It runs once uninterrupted, then once more stopped K times and relaunched "
        "(each run in a fresh folder for {dir}); the newest checkpoints, and every step both runs still hold, are "
        "compared part by part: exit 0 exact, 1 different (with a diagnosis where one is known)",
        "print the result as JSON (schema dist-resume/check/1)",
    )
    p.add_argument("--interrupts", type=int, default=2, metavar="K", help="how many times to stop the run (default 2)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the moments the stops come at (default 0)")
    p.add_argument(
        "--signal",
        type=str.upper,
        choices=["KILL", "TERM"],
        default="KILL",
        help="KILL (default): SIGKILL to the whole process tree, as a preemption; TERM: SIGTERM to the command's "
        "process group (torchrun forwards it), SIGKILL 30 s later",
    )
    p.add_argument("--timeout", type=float, metavar="SECONDS", help="the longest one run of COMMAND may take")
    p.add_argument(
        "--device",
        choices=["sim"],
        help="sim: every Python process of COMMAND runs on the test accelerator (simulated devices on the CPU, "
        "sim:LOCAL_RANK; dist_resume.testing.sim)",
    )
    p.add_argument("--keep", action="store_true", help="keep both checkpoint folders and the logs; print their paths")
    p.add_argument(
        "--strict-extra",
        action="store_true",
        help="count a difference in extra (the script's own entries, such as args written after a resume) as a "
        "difference; by default the resume is exact when only extra differs, and the keys that differ are named",
    )
    p.add_argument(
        "command_argv",  # not "command": that is the subcommand's name (report_error says it)
        nargs=argparse.REMAINDER,
        metavar="-- COMMAND",
        help="the training command, {dir} where it takes its checkpoint folder (e.g. -- torchrun --standalone "
        "--nproc_per_node=2 train.py --ckpt {dir})",
    )
    add(
        "env",
        cmd_env,
        "what torchrun set, this process's RankInfo, device and default backend "
        "(e.g. `torchrun ... -m dist_resume env`)",
        "print the report as JSON (schema dist-resume/env/1)",
    )
    return parser
