"""Coverage-guided fuzzing (atheris, libFuzzer) of the bytes of valid dist_resume files through the public readers.

Usage::

    python scripts/fuzz_atheris.py -runs=2000 -seed=1                  # a seeded slice (tests/test_fuzz_atheris.py)
    python scripts/fuzz_atheris.py -max_total_time=600 -seed=7 --corpus DIR --artifacts DIR   # a long run
    python scripts/fuzz_atheris.py --only manifest,dcp_metadata -runs=500   # some kinds of input only
    python scripts/fuzz_atheris.py CRASH_FILE                         # replay one input (a crash-... file)

An input is one byte naming a kind, then the bytes of one file of that kind, written into a copy of a valid
checkpoint (``scripts/_fuzz_corpus.py``'s corpus) in place of the file it replaces:

- ``pt``: a dist_resume checkpoint file (``save_checkpoint``): ``load_checkpoint``, ``inspect_checkpoint``,
  ``verify_archive``, ``resume`` into fresh objects (model, SGD, scheduler, GradScaler, EMA);
- ``manifest``, ``sharded_metadata``, ``train_state``: the ``manifest.json``, DCP ``.metadata`` or ``train_state.pt``
  of a run's newest sharded checkpoint (``ckpt_2.dcp/``): the three readers by path, ``resume`` of it, and
  ``latest_checkpoint`` of the run folder (which must name ``ckpt_2.dcp`` or the older ``ckpt_1.dcp``);
- ``pt_values``: the same file, its bytes not mutated but its values: the input reads as up to four edits, three
  bytes each (a place in the loaded object, then what goes there: a tensor of another kind, sparse, nested,
  quantized, meta or expanded, a number past its range, or nothing), applied and saved again with ``torch.save``
  (``_fuzz_structural.py``'s generators, which the Hypothesis strategies share); the same readers as ``pt``;
- ``dcp_metadata``: the ``.metadata`` of a ``dcp.save`` folder; ``trainer_state``, ``hf_index``: an HF Trainer
  checkpoint's ``trainer_state.json`` and ``model.safetensors.index.json``; ``safetensors``: a ``.safetensors`` file:
  ``load_checkpoint``, ``inspect_checkpoint`` and ``resume`` of each.

Success and a ``DistResumeError`` are fine; any other exception is a crash (libFuzzer writes the input as
``crash-<sha1>`` under ``--artifacts`` and prints the traceback), and so is a refused resume that left a live object
or an RNG stream changed (``AssertionError: half-restore``). Only ``dist_resume`` is instrumented. Before fuzzing,
each seed must succeed on every reader (exit status 2 if one does not: the targets would fuzz refusals only).
libFuzzer's own options (``-runs``, ``-seed``, ``-max_total_time``, ``-timeout``, ``-rss_limit_mb``...) pass through;
its exit status is 0 when nothing was found.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import pkgutil
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NOT_INSTRUMENTED = ("dist_resume.__main__", "dist_resume.testing", "dist_resume._sim", "dist_resume.cli.check")


def _instrumented_import() -> None:
    """Import dist_resume, every module the readers may import lazily included, with atheris's coverage hooks; torch
    first, outside them: only dist_resume is instrumented."""
    import atheris
    import torch  # noqa: F401

    with atheris.instrument_imports(include=["dist_resume"]):
        import dist_resume

        for module in pkgutil.walk_packages(dist_resume.__path__, "dist_resume."):
            if not module.name.startswith(NOT_INSTRUMENTED):
                with contextlib.suppress(ImportError):  # a module of an optional extra (s3fs...)
                    importlib.import_module(module.name)


KINDS = (
    "pt",
    "pt_values",
    "manifest",
    "sharded_metadata",
    "train_state",
    "dcp_metadata",
    "trainer_state",
    "hf_index",
    "safetensors",
)
# kind -> (corpus item, the file an input replaces, relative to the item; "" for a file item)
MEMBERS = {
    "pt": ("own", ""),
    "pt_values": ("own", ""),
    "manifest": ("sharded_run", "ckpt_2.dcp/manifest.json"),
    "sharded_metadata": ("sharded_run", "ckpt_2.dcp/.metadata"),
    "train_state": ("sharded_run", "ckpt_2.dcp/train_state.pt"),
    "dcp_metadata": ("dcp", ".metadata"),
    "trainer_state": ("hf", "trainer_state.json"),
    "hf_index": ("hf_sharded", "model.safetensors.index.json"),
    "safetensors": ("safetensors", ""),
}
RESTORED = {  # what resume is given for each kind's source: what it holds
    "pt": ("model", "optimizer", "scheduler", "scaler", "ema"),
    "pt_values": ("model", "optimizer", "scheduler", "scaler", "ema"),
    "sharded": ("model", "optimizer", "scheduler", "scaler", "ema"),
    "dcp_metadata": ("model", "optimizer"),
    "trainer_state": ("model", "scheduler"),
    "hf_index": ("model",),
    "safetensors": ("model",),
}


class Target:
    """The copies of the corpus the inputs are written into, and the readers run on each."""

    def __init__(self, corpus: dict[str, Path], work: Path, only: tuple[str, ...]) -> None:
        self.kinds = only
        self.places: dict[str, tuple[Path, Path]] = {}  # kind -> (what the readers read, the file an input replaces)
        for kind in only:
            item, member = MEMBERS[kind]
            source = corpus[item]
            home = work / kind
            if source.is_dir():
                shutil.copytree(source, home / source.name)
                root = home / source.name
                read = root / member.split("/")[0] if "/" in member else root
                self.places[kind] = (read, root / member)
            else:
                home.mkdir(parents=True)
                shutil.copy(source, home / source.name)
                self.places[kind] = (home / source.name, home / source.name)
        self.seeds = {kind: self.places[kind][1].read_bytes() for kind in only}
        if "pt_values" in only:  # its input is edits, none in the seed: the sound file
            import torch
            from _fuzz_structural import places

            self.seeds["pt_values"] = b""
            self.loaded = torch.load(self.places["pt_values"][1], weights_only=True)
            self.value_places = places(self.loaded)

    def valued(self, data: bytes) -> bytes:
        """The ``pt_values`` file an input stands for: its edits (three bytes each: a place, then a value) applied to
        the sound file's object, saved again with torch.save."""
        import copy
        import io

        import torch
        from _fuzz_structural import ODD_VALUES, TENSOR_KINDS, edited, places

        obj, where = self.loaded, self.value_places
        for i in range(0, min(len(data), 12) - 2, 3):
            if obj is not self.loaded:  # an edit may have removed or replaced a place: the places now
                where = places(obj)
            place = where[int.from_bytes(data[i : i + 2], "big") % len(where)]
            choice = data[i + 2] % (len(TENSOR_KINDS) + len(ODD_VALUES) + 1)
            if choice < len(TENSOR_KINDS):
                obj = edited(obj, place, "kind", TENSOR_KINDS[choice], None)
            elif choice < len(TENSOR_KINDS) + len(ODD_VALUES):
                obj = edited(obj, place, "set", copy.deepcopy(ODD_VALUES[choice - len(TENSOR_KINDS)]), None)
            elif place:
                obj = edited(obj, place, "drop", None, None)
        buf = io.BytesIO()
        torch.save(obj, buf)
        return buf.getvalue()

    def run(self, data: bytes) -> None:
        """One input: the kind its first byte names, the rest the file's bytes. Raises what a reader let out."""
        import dist_resume as dr

        if not data:
            return
        kind = self.kinds[data[0] % len(self.kinds)]
        read, replaced = self.places[kind]
        fresh = replaced.with_name(replaced.name + ".next")
        fresh.write_bytes(self.valued(data[1:]) if kind == "pt_values" else data[1:])
        os.replace(fresh, replaced)  # a new inode: nothing this process cached about the last input applies
        readers: list[Callable[[], Any]] = [
            lambda: dr.load_checkpoint(read, map_location="cpu"),
            lambda: dr.tools.inspect_checkpoint(read),
            lambda: self.resume(kind, read),
        ]
        if kind.startswith("pt") or MEMBERS[kind][0] == "sharded_run":
            readers.append(lambda: dr.tools.verify_archive(read))
        if MEMBERS[kind][0] == "sharded_run":
            readers.append(lambda: self.latest(read))
        for reader in readers:
            try:
                reader()
            except dr.DistResumeError:
                pass

    def resume(self, kind: str, read: Path) -> None:
        from _fuzz_corpus import averaged, trained
        from _fuzz_half_restore import CHANGED, all_or_nothing

        import dist_resume as dr

        model, opt, sched, scaler = trained(seed=5, steps=2)
        every: dict[str, Any] = {
            "model": model,
            "optimizer": opt,
            "scheduler": sched,
            "scaler": scaler,
            "ema": averaged(model, 2),
        }
        wanted = RESTORED["sharded" if MEMBERS[kind][0] == "sharded_run" else kind]
        objects = {name: every[name] for name in wanted}
        CHANGED.clear()
        try:
            all_or_nothing(objects, lambda: dr.resume(read, **objects, options=dr.ResumeOptions(map_location="cpu")))
        except dr.DistResumeError as err:
            if CHANGED:
                raise AssertionError(f"half-restore: {type(err).__name__} left changed: {', '.join(CHANGED)}") from err
            raise

    def latest(self, newest: Path) -> None:
        import dist_resume as dr

        found = dr.tools.latest_checkpoint(newest.parent)
        if found is None or Path(found).name not in (newest.name, "ckpt_1.dcp"):
            raise AssertionError(f"latest_checkpoint named {found}, neither the newest nor the older checkpoint")

    def check_seeds(self) -> list[str]:
        """Each seed through every reader: what did not succeed (the targets must pass a valid file)."""
        import dist_resume as dr

        failed = []
        for i, kind in enumerate(self.kinds):
            try:
                with _quiet():
                    self.run(bytes([i]) + self.seeds[kind])
                    read = self.places[kind][0]
                    dr.load_checkpoint(read, map_location="cpu")
                    self.resume(kind, read)
            except Exception as err:  # a refusal of a valid file is a failure here too
                failed.append(f"{kind}: {type(err).__name__}: {err}")
        return failed


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def serve(only: tuple[str, ...], work: Path, corpus: Path | None, artifacts: Path | None, libfuzzer: list[str]) -> int:
    """Build the corpus into ``work``, check the seeds, then hand the process to libFuzzer (which exits it)."""
    _instrumented_import()
    import atheris
    import torch
    from _fuzz_corpus import build_corpus

    torch.set_num_threads(1)
    logging.getLogger("dist_resume").setLevel(logging.CRITICAL)
    logging.getLogger("dist_resume").propagate = False
    warnings.simplefilter("ignore")
    with _quiet():
        target = Target(build_corpus(work / "corpus"), work / "target", only)
    failed = target.check_seeds()
    if failed:
        print("seeds that do not succeed:\n  " + "\n  ".join(failed), file=sys.stderr)
        return 2
    replaying = [a for a in libfuzzer if not a.startswith("-") and Path(a).is_file()]
    seeds = corpus or work / "seeds"
    seeds.mkdir(parents=True, exist_ok=True)
    if not replaying:
        for i, kind in enumerate(only):
            (seeds / f"seed-{kind}").write_bytes(bytes([i]) + target.seeds[kind])
    flags = [a for a in libfuzzer if a.startswith("-")]
    if artifacts is not None:
        artifacts.mkdir(parents=True, exist_ok=True)
        flags.append(f"-artifact_prefix={artifacts}{os.sep}")
    if not any(f.startswith("-rss_limit_mb=") for f in flags):
        flags.append("-rss_limit_mb=4096")  # torch and the corpus take ~0.4 GB; libFuzzer's default is 2 GB
    if not any(f.startswith("-timeout=") for f in flags):
        flags.append("-timeout=60")
    argv = [sys.argv[0], *flags, *(replaying or [str(seeds)])]
    print(f"fuzz_atheris: kinds {', '.join(only)}; libFuzzer {' '.join(argv[1:])}", file=sys.stderr, flush=True)
    atheris.Setup(argv, target.run)
    atheris.Fuzz()  # libFuzzer exits the process: no finally, no atexit
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], allow_abbrev=False, epilog="Other options go to libFuzzer (-runs=N ...)."
    )
    parser.add_argument("--only", default=",".join(KINDS), help=f"comma-separated kinds of input ({', '.join(KINDS)})")
    parser.add_argument("--corpus", type=Path, default=None, help="libFuzzer's corpus folder (default: a temp folder)")
    parser.add_argument("--artifacts", type=Path, default=None, help="where crash-* inputs go (default: the cwd)")
    parser.add_argument("--work", type=Path, default=None, help=argparse.SUPPRESS)  # the libFuzzer process's folder
    args, libfuzzer = parser.parse_known_args(argv)
    only = tuple(k.strip() for k in args.only.split(",") if k.strip())
    unknown = [k for k in only if k not in KINDS]
    if unknown:
        parser.error(f"unknown kinds {unknown}; known: {', '.join(KINDS)}")
    if args.work is not None:
        return serve(only, args.work, args.corpus, args.artifacts, libfuzzer)
    # libFuzzer ends its process with exit(): the fuzzing runs in a child, and this one removes its temporary folder
    work = Path(tempfile.mkdtemp(prefix="fuzz_atheris_"))
    try:
        own = sys.argv[1:] if argv is None else argv
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        child = [sys.executable, str(Path(__file__).resolve()), *own, "--work", str(work)]
        return subprocess.run(child, env=env).returncode
    except KeyboardInterrupt:
        return 130
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
