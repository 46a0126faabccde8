"""What each ``dist-resume`` subcommand does with its parsed arguments: one thin handler per subcommand."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from .._core.errors import EnvironmentMismatchError
from ._common import ExitCode, ProgressBar, UsageError, human_bytes, print_json, report_error

__all__ = ["cmd_inspect", "cmd_convert", "cmd_verify", "cmd_list", "cmd_env", "cmd_check", "part_keys_arg"]


def part_keys_arg(items: Sequence[str] | None) -> dict[str, str] | None:
    """``--part model=MODEL_STATE`` (repeatable) as ``part_keys``; a malformed item is a usage error."""
    if not items:
        return None
    from .._layout.detect import check_part_keys  # torch's: only a command given --part needs it
    from .._layout.kinds import PART_NAMES

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


def cmd_inspect(args: argparse.Namespace) -> int:
    from .inspect import describe_checkpoint, render_inspect

    report = describe_checkpoint(args.checkpoint, part_keys=part_keys_arg(args.part))
    if args.json:
        print_json(report)
    elif not args.quiet:
        print(render_inspect(report))
    return ExitCode.OK


def cmd_convert(args: argparse.Namespace) -> int:
    from .._convert.convert import convert_checkpoint

    if args.into is not None or args.step is not None or args.steps_per_epoch is not None:
        return _convert_into(args)
    if args.dst is None:
        raise UsageError(
            "convert needs DST, or --into FOLDER",
            "DST: the file or folder to write (with --to, --format or both); --into FOLDER: SRC as the checkpoint "
            "of its step in a CheckpointManager folder",
        )
    if args.to is None and args.format is None:
        raise UsageError(
            "convert needs --to, --format or both",
            "--to ddp|single re-keys the model; --format pt|safetensors|dcp|sharded picks the output format",
        )
    bar = ProgressBar.for_stderr("converting", quiet=args.quiet or args.json)
    try:
        result = convert_checkpoint(
            args.src,
            args.dst,
            args.to,
            format=args.format or "pt",
            part_keys=part_keys_arg(args.part) or None,
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


def _convert_into(args: argparse.Namespace) -> int:
    """``convert SRC --into FOLDER [--step N]``: SRC as FOLDER's checkpoint of its step."""
    from .._manager.adopt import convert_into_folder
    from .._manager.resume_point import ResumePoint

    if args.into is None:
        given = "--step" if args.step is not None else "--steps-per-epoch"
        raise UsageError(
            f"{given} applies to --into FOLDER only", "e.g. dist-resume convert ckpt.pt --into run --step 300"
        )
    if args.dst is not None:
        raise UsageError(
            f"give DST or --into FOLDER, not both (DST {str(args.dst)!r}, --into {str(args.into)!r})",
            "--into FOLDER names the checkpoint file itself (FOLDER/ckpt_<step>.pt)",
        )
    if args.to == "ddp" or args.format not in (None, "pt"):
        given = "--to ddp" if args.to == "ddp" else f"--format {args.format}"
        raise UsageError(
            f"{given} does not apply to --into: a CheckpointManager folder holds files in its own format (model "
            "keys without module./_orig_mod., read into any wrapper)",
            f"leave {given.split()[0]} out",
        )
    result = convert_into_folder(
        args.src,
        args.into,
        step=args.step,
        steps_per_epoch=args.steps_per_epoch,
        force=args.force,
        part_keys=part_keys_arg(args.part) or None,
        check_crc=args.check_crc,
    )
    if args.json:
        print_json(
            {
                "schema": "dist-resume/convert-into/1",
                "src": str(result.src),
                "path": str(result.path),
                "step": result.step,
                "step_from": result.step_from,
                "epoch": result.epoch,
                "epoch_from": result.epoch_from,
                "layout": result.layout.value,
                "prefix_before": result.prefix_before,
                "model_keys": result.model_keys,
                "replaced": result.replaced,
                "bytes_written": result.bytes_written,
                "seconds": round(result.seconds, 3),
            }
        )
    elif not args.quiet:
        point = ResumePoint(result.step, result.step_from, result.epoch, result.epoch_from)
        print(
            f"wrote {result.path} ({human_bytes(result.bytes_written)}, {result.seconds:.2f}s): {result.layout.value} "
            f"as the checkpoint of step {result.step}, model keys {result.prefix_before} -> none "
            f"({result.model_keys} keys){'; replaced the one there' if result.replaced else ''}\n"
            f"CheckpointManager({str(result.path.parent)!r}, ...).resume() continues at {point.said()}"
        )
    return ExitCode.OK


def cmd_verify(args: argparse.Namespace) -> int:
    from ._verify import render_verify, verify_checkpoints

    report = verify_checkpoints(args.a, args.b, part_keys=part_keys_arg(args.part))
    if args.json:
        print_json(report)
    elif not args.quiet:
        print(render_verify(report))
    return ExitCode.OK if report["equal"] else ExitCode.DIFFERENT


def cmd_list(args: argparse.Namespace) -> int:
    from ._list import list_folder, render_list

    report = list_folder(args.folder, verify=args.verify)
    if args.json:
        print_json(report)
    elif not args.quiet:
        print(render_list(report))
    return ExitCode.OK


def cmd_env(args: argparse.Namespace) -> int:
    from ._env import environment_report, render_env

    report = environment_report()
    distributed = bool(report["rank_info"] and report["rank_info"]["is_distributed"])
    if args.json:
        print_json(report, compact=distributed)  # one line per rank: ranks' outputs do not interleave
    elif not args.quiet:
        print(render_env(report), flush=True)
    if report["problems"]:
        report_error("env", EnvironmentMismatchError(report["problems"][0]))
        return ExitCode.INPUT
    return ExitCode.OK


def cmd_check(args: argparse.Namespace) -> int:
    from .check import main_check

    return main_check(args)
