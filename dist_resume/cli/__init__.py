"""The ``dist-resume`` command (also ``python -m dist_resume``): inspect, convert, verify, list, env.

Every subcommand is a thin layer over library functions; errors are one line on stderr plus a hint,
and the exit status is one of :class:`ExitCode`.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from .._core.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    DistResumeError,
    EnvironmentMismatchError,
    KeyMismatchError,
    NotACheckpointError,
    UnsafeCheckpointError,
)
from ._common import ExitCode, ProgressBar, UsageError, human_bytes, print_json

__all__ = ["main", "build_parser"]

PROG = "dist-resume"
EPILOG = """\
exit status:
  0  success (verify: the checkpoints are equal)
  1  verify: the checkpoints differ (the differences are listed)
  2  usage or input error: bad arguments; a missing, empty, truncated, damaged, unsafe or
     unrecognised checkpoint; SRC == DST; DST exists without --force; inconsistent torchrun variables
  3  the output could not be written (permissions, disk full, missing folder); DST is untouched
  4  internal error (a bug: please report it with the traceback)
  130 interrupted

dist-resume reads only what torch.load(weights_only=True) accepts and never runs code from a file.
--json output carries a "schema" field ("dist-resume/<command>/1") that changes only with the format.
"""

_HINTS: tuple[tuple[type[BaseException], str], ...] = (
    (CheckpointNotFoundError, "check the path"),
    (CheckpointCorruptError, "the file is incomplete or damaged: use an earlier checkpoint"),
    (UnsafeCheckpointError, "dist-resume only reads what torch.load(weights_only=True) accepts"),
    (NotACheckpointError, "dist-resume reads checkpoints written by torch.save (zip format, torch >= 1.6)"),
    (CheckpointWriteError, "check free space and permissions in the destination folder"),
    (KeyMismatchError, "inspect the file with `dist-resume inspect` to see its keys"),
    (EnvironmentMismatchError, "these variables are set by torchrun: unset them, or launch with torchrun"),
    (DistResumeError, "run `dist-resume inspect` on the file for details"),
)


def _part_keys(items: Sequence[str] | None) -> dict[str, str] | None:
    """``--part model=MODEL_STATE`` (repeatable) as ``part_keys``; a malformed item is a usage error."""
    if not items:
        return None
    from .._format.detect import check_part_keys
    from .._format.kinds import PART_NAMES

    out: dict[str, str] = {}
    for item in items:
        part, eq, key = item.partition("=")
        if not eq or not part.strip() or not key.strip():
            raise UsageError(
                f"--part {item!r} is not PART=KEY",
                hint=f"e.g. --part model=MODEL_STATE; the parts are {', '.join(PART_NAMES)}",
            )
        out[part.strip()] = key.strip()
    return check_part_keys(out)


def _cmd_inspect(args: argparse.Namespace) -> int:
    from ._inspect import describe_checkpoint, render_inspect

    report = describe_checkpoint(args.checkpoint, part_keys=_part_keys(args.part))
    if args.json:
        print_json(report)
    elif not args.quiet:
        print(render_inspect(report))
    return ExitCode.OK


def _cmd_convert(args: argparse.Namespace) -> int:
    from .._format.convert import convert_checkpoint

    if args.to is None and args.format is None:
        raise UsageError(
            "convert needs --to, --format or both",
            "--to ddp|single re-keys the model; --format pt|safetensors|dcp picks the output format",
        )
    bar = ProgressBar.for_stderr("converting", quiet=args.quiet or args.json)
    try:
        result = convert_checkpoint(
            args.src,
            args.dst,
            args.to,
            format=args.format or "pt",
            part_keys=_part_keys(args.part) or None,
            force=args.force,
            check_crc=args.check_crc,
            progress=bar,
        )
    finally:
        bar.close()
    summary = {
        "schema": "dist-resume/convert/1",
        "src": str(result.src),
        "dst": str(result.dst),
        "to": result.to.value if result.to is not None else None,
        "format": result.format.value,
        "layout": result.layout.value,
        "prefix_before": result.prefix_before,
        "prefix_after": result.prefix_after,
        "model_keys": result.model_keys,
        "renamed_keys": result.renamed_keys,
        "param_names": result.param_names,
        "bytes_written": result.bytes_written,
        "seconds": round(result.seconds, 3),
    }
    if args.json:
        print_json(summary)
    elif not args.quiet:
        print(
            f"wrote {result.dst} ({result.format.value}, {human_bytes(result.bytes_written)}, "
            f"{result.seconds:.2f}s): {result.layout.value}, "
            f"model keys {result.prefix_before} -> {result.prefix_after} ({result.renamed_keys} of "
            f"{result.model_keys} renamed)"
            + (f", optimizer param_names re-keyed ({result.param_names})" if result.param_names else "")
        )
    return ExitCode.OK


def _cmd_verify(args: argparse.Namespace) -> int:
    from ._verify import render_verify, verify_checkpoints

    report = verify_checkpoints(args.a, args.b, part_keys=_part_keys(args.part))
    if args.json:
        print_json(report)
    elif not args.quiet:
        print(render_verify(report))
    return ExitCode.OK if report["equal"] else ExitCode.DIFFERENT


def _cmd_list(args: argparse.Namespace) -> int:
    from ._list import list_folder, render_list

    report = list_folder(args.folder, verify=args.verify)
    if args.json:
        print_json(report)
    elif not args.quiet:
        print(render_list(report))
    return ExitCode.OK


def _cmd_env(args: argparse.Namespace) -> int:
    from ._env import environment_report, render_env

    report = environment_report()
    distributed = bool(report["rank_info"] and report["rank_info"]["is_distributed"])
    if args.json:
        print_json(report, compact=distributed)  # one line per rank: ranks' outputs do not interleave
    elif not args.quiet:
        print(render_env(report), flush=True)
    if report["problems"]:
        _error("env", EnvironmentMismatchError(report["problems"][0]))
        return ExitCode.INPUT
    return ExitCode.OK


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``dist-resume``."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect, convert and compare PyTorch checkpoints; show what torchrun set.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from .._core.version import __version__

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
        _cmd_inspect,
        "what a checkpoint holds: layout, which key each part came from, prefixes, tensors per dtype, "
        "device tags, optimizer and its hyper-parameters, metadata, warnings (reads no tensor data)",
        "print the report as JSON (schema dist-resume/inspect/1)",
    )
    p.add_argument("checkpoint", type=Path, metavar="CKPT")
    p.add_argument(
        "--part",
        action="append",
        metavar="PART=KEY",
        help="take PART (model, optimizer, scheduler, scaler, ema, epoch, step) from KEY ('outer.inner' one "
        "level down) instead of detecting it; repeatable",
    )
    p = add(
        "convert",
        _cmd_convert,
        "re-key model keys and optimizer param_names for a single-process or a DDP model, and/or write "
        "another format (.pt, .safetensors, DCP folder); .pt <-> .safetensors copies tensor bytes as they are",
        "print a JSON summary (schema dist-resume/convert/1)",
    )
    p.add_argument("src", type=Path, metavar="SRC", help="a .pt/.ckpt/.safetensors file or a checkpoint folder")
    p.add_argument("dst", type=Path, metavar="DST")
    p.add_argument(
        "--to",
        choices=["ddp", "single"],
        help="ddp: keys as DistributedDataParallel/DataParallel expect ('module.' added); "
        "single: keys of the plain model ('module.'/'_orig_mod.' removed in every nesting)",
    )
    p.add_argument(
        "--format",
        choices=["pt", "safetensors", "dcp"],
        help="pt (default): a torch zip file (a .pt source keeps its layout; others become dist_resume files); "
        "safetensors: model weights only, plain keys unless --to ddp; dcp: a torch.distributed.checkpoint "
        "folder {'model', 'optim'} keyed by FQN, for dcp.load/set_state_dict",
    )
    p.add_argument(
        "--part",
        action="append",
        default=[],
        metavar="PART=KEY",
        help="which entry holds a part, where detection should not decide (e.g. model=MODEL_STATE, "
        "optimizer=state.opt); repeatable",
    )
    p.add_argument("--force", action="store_true", help="replace DST if it exists")
    p.add_argument(
        "--check-crc",
        action="store_true",
        help="check the CRC32 of every record of SRC first (reads the whole file once more)",
    )
    p = add(
        "verify",
        _cmd_verify,
        "compare the parts detected in two checkpoints (model weights under canonical keys; optimizer, "
        "epoch, step, scheduler, GradScaler where both have them): keys, shapes, dtypes, bitwise values; "
        "exit 0 equal, 1 different",
        "print the report as JSON (schema dist-resume/verify/1)",
    )
    p.add_argument("a", type=Path, metavar="A")
    p.add_argument("b", type=Path, metavar="B")
    p.add_argument(
        "--part",
        action="append",
        metavar="PART=KEY",
        help="take PART from KEY in whichever file holds KEY, instead of detecting it; repeatable",
    )
    p = add(
        "list",
        _cmd_list,
        "a checkpoint folder's checkpoints (step, epoch, size, age, world size, valid or damaged and why), "
        "temporary files left by killed saves, and the one resume would pick; also an HF Trainer output folder",
        "print the report as JSON (schema dist-resume/list/1)",
    )
    p.add_argument("folder", type=Path, metavar="DIR")
    p.add_argument("--verify", action="store_true", help="check the CRC32 of every record (reads every file once)")
    add(
        "env",
        _cmd_env,
        "what torchrun set, this process's RankInfo, device and default backend "
        "(e.g. `torchrun ... -m dist_resume env`)",
        "print the report as JSON (schema dist-resume/env/1)",
    )
    return parser


def _one_line(text: str) -> str:
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def _error(command: str, err: BaseException) -> None:
    hint = err.hint if isinstance(err, UsageError) else next(h for cls, h in _HINTS if isinstance(err, cls))
    sys.stderr.write(f"{PROG} {command}: error: {_one_line(str(err))}\nhint: {hint}\n")
    sys.stderr.flush()


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``dist-resume`` with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version, usage errors (argparse has printed them)
        return int(exit_.code or 0) if not isinstance(exit_.code, str) else ExitCode.INPUT
    try:
        return int(args.func(args))
    except CheckpointWriteError as err:
        _error(args.command, err)
        return ExitCode.WRITE
    except DistResumeError as err:
        _error(args.command, err)
        return ExitCode.INPUT
    except KeyboardInterrupt:
        sys.stderr.write(f"{PROG} {args.command}: interrupted\n")
        return ExitCode.INTERRUPTED
    except BrokenPipeError:  # `dist-resume inspect x | head`
        return ExitCode.OK
    except Exception:
        traceback.print_exc()
        sys.stderr.write(
            f"{PROG} {args.command}: internal error (a bug in dist-resume); please report the traceback above\n"
        )
        return ExitCode.INTERNAL


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
