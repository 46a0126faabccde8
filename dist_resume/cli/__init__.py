"""The ``dist-resume`` command (also ``python -m dist_resume``): inspect, convert, verify, list, env.

Every subcommand is a thin layer over library functions; errors are one line on stderr plus a hint,
and the exit status is one of :class:`ExitCode`.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Sequence

from .._core.errors import CheckpointWriteError, DistResumeError
from ._common import ExitCode, report_error
from ._parser import PROG, build_parser

__all__ = ["main", "build_parser"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``dist-resume`` with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version, usage errors (argparse has printed them)
        return int(exit_.code or 0) if not isinstance(exit_.code, str) else ExitCode.INPUT
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        sys.stderr.write(f"{PROG} {args.command}: interrupted\n")
        return ExitCode.INTERRUPTED
    except BrokenPipeError:  # `dist-resume inspect x | head`
        return ExitCode.OK
    except (SystemExit, GeneratorExit):
        raise
    except BaseException as err:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        return _failed(args.command, err)


def _failed(command: str, err: BaseException) -> int:
    """Say what failed, and return its exit status: the cause a DCP wrapper holds is reported as that cause."""
    cause = err
    if not isinstance(err, Exception):  # imported here: only torch.distributed.checkpoint raises one (torch is loaded)
        from .._core.torch_compat.wording import dcp_cause

        cause = dcp_cause(err)
    if isinstance(cause, DistResumeError):
        report_error(command, cause)
        return ExitCode.WRITE if isinstance(cause, CheckpointWriteError) else ExitCode.INPUT
    traceback.print_exception(err)
    sys.stderr.write(f"{PROG} {command}: internal error (a bug in dist-resume); please report the traceback above\n")
    return ExitCode.INTERNAL


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
