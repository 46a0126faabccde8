"""``dist-resume verify``: are two checkpoints the same training state, modulo ``module.``/``_orig_mod.`` prefixes?"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .._core.errors import UsageError
from .._core.location import Location
from .._core.text import preview
from ._common import SCHEMA_PREFIX
from ._fast_verify import fast_verify

if TYPE_CHECKING:
    from .._layout.layout import CheckpointParts

__all__ = ["verify_checkpoints", "render_verify", "read_parts"]

SCHEMA = f"{SCHEMA_PREFIX}/verify/1"


def _keys_held(obj: Any, part_keys: Mapping[str, str] | None) -> dict[str, str] | None:
    """The entries of ``part_keys`` whose key ``obj`` holds (``verify --part`` names a key in either file)."""
    if not part_keys or not isinstance(obj, Mapping):
        return None
    out = {}
    for part, path in part_keys.items():
        outer, _, inner = path.partition(".")
        if path in obj or (inner and isinstance(obj.get(outer), Mapping) and inner in obj[outer]):
            out[part] = path
    return out or None


def _side(path: Location, parts: CheckpointParts) -> dict[str, Any]:
    from .._state.prefix import prefix_style

    return {
        "path": str(path),
        "layout": parts.layout.value,
        "prefix_style": prefix_style(parts.model),
        "part_keys": dict(parts.keys),
    }


def verify_checkpoints(
    a: Location, b: Location, *, part_keys: Mapping[str, str] | None = None, fast: bool = True
) -> dict[str, Any]:
    """The ``verify --json`` report: the parts detected in ``a`` and ``b``, compared modulo prefixes.

    Local. Model weights are compared under their canonical keys; the optimizer, epoch, step,
    scheduler and GradScaler where both files have them (a part only one file has is listed in
    ``not_compared``). ``part_keys`` (``verify --part``) names keys for parts in whichever file
    holds them. Both files are memory-mapped on the CPU; tensors are compared bitwise, a chunk at a time. A
    sharded checkpoint folder (an FSDP2 save) is first checked against its manifest (every file's size and CRC-32).

    ``fast`` (default): two equal files of this toolkit are confirmed without torch (:mod:`._fast_verify`); anything
    else (a difference, another layout, any doubt) is compared by the torch path, so the report is the same.
    """
    if fast and not part_keys:
        try:
            return fast_verify(a, b)
        except Exception:  # PeekUnsure (a difference, another layout, a doubt) or the unforeseen: the torch path
            pass
    from .._layout.detect import check_part_keys
    from .._layout.layout import split_checkpoint
    from .._source.open import open_checkpoint
    from ._compare import compare_parts
    from .inspect import check_sharded

    for side in (a, b):  # a sharded checkpoint folder is checked whole first: damage is said naming the file
        check_sharded(side)
    if part_keys:
        check_part_keys(part_keys)
    # foreign sources (HF Trainer, Accelerate, DCP, safetensors) come back already split into parts
    contents_a, contents_b = (open_checkpoint(p, map_location="cpu", mmap=_mmap(p), weights_only=True) for p in (a, b))
    obj_a, obj_b = contents_a.obj, contents_b.obj
    held_a, held_b = _keys_held(obj_a, part_keys), _keys_held(obj_b, part_keys)
    if part_keys:
        unused = [
            f"{part}={key}"
            for part, key in part_keys.items()
            if not (held_a or {}).get(part) and not (held_b or {}).get(part)
        ]
        if unused:
            raise UsageError(
                f"--part {preview(unused, quote=False)}: neither {str(a)!r} nor {str(b)!r} has that key",
                hint="run `dist-resume inspect` on each file to see its keys",
            )
    pa = contents_a.parts or split_checkpoint(obj_a, source=str(a), part_keys=held_a)
    pb = contents_b.parts or split_checkpoint(obj_b, source=str(b), part_keys=held_b)
    report = compare_parts(pa, pb)
    return {
        "schema": SCHEMA,
        "a": _side(a, pa),
        "b": _side(b, pb),
        "equal": not report.differences,
        "compared": {
            "model_tensors": report.tensors["model"],
            "optimizer_tensors": report.tensors["optimizer"],
            "bytes": report.bytes,
        },
        "not_compared": report.not_compared,
        "differences": report.differences,
    }


def read_parts(path: Location) -> CheckpointParts:
    """A checkpoint's parts as ``verify`` reads them (and ``resume`` finds them): a sharded checkpoint folder checked
    against its manifest first, a torch file memory-mapped on the CPU and split by :func:`split_checkpoint`, a
    foreign source split by its reader. Local."""
    from .._layout.layout import split_checkpoint
    from .._source.open import open_checkpoint
    from .inspect import check_sharded

    check_sharded(path)
    contents = open_checkpoint(path, map_location="cpu", mmap=_mmap(path), weights_only=True)
    return contents.parts or split_checkpoint(contents.obj, source=str(path))


def _mmap(path: Location) -> bool:
    from .._format.sniff import FileKind, check_file, file_kind
    from .._source.source import local_source

    return local_source(path).layout is not None or file_kind(check_file(path)) is not FileKind.LEGACY


def _where(side: Mapping[str, Any]) -> str:
    # describe_keys' words (dist_resume._layout.layout, which imports torch; tests/test_cli_fast.py checks they agree)
    keys = ", ".join(f"{part} <- {key!r}" for part, key in (side.get("part_keys") or {}).items())
    return f"{side['layout']}, prefix {side['prefix_style']}" + (f"; {keys}" if keys else "")


def render_verify(report: dict[str, Any], limit: int = 20) -> str:
    """The human-readable form of a :func:`verify_checkpoints` report."""
    c = report["compared"]
    optim = f" and {c['optimizer_tensors']} optimizer" if c["optimizer_tensors"] else ""
    head = f"{c['model_tensors']} model{optim} tensors compared"
    lines = []
    if report["equal"]:
        lines.append(f"equal: {head}")
    else:
        diffs = report["differences"]
        lines.append(f"different: {len(diffs)} difference{'s' if len(diffs) != 1 else ''}; {head}")
    lines.append(f"  A: {_where(report['a'])}")
    lines.append(f"  B: {_where(report['b'])}")
    if report.get("not_compared"):
        lines.append(f"  not compared: {', '.join(report['not_compared'])}")
    if not report["equal"]:
        diffs = report["differences"]
        shown = preview(
            (f"{d['part']}{'' if d['key'] == '-' else ' ' + d['key']}: {d['problem']}" for d in diffs),
            limit,
            sep="\n  ",
            quote=False,
        )
        lines.append(f"  {shown}" + (" (--json lists all)" if len(diffs) > limit else ""))
    return "\n".join(lines)
