"""What all-or-nothing apply costs: time and peak anonymous memory of ``RestorePlan.apply`` against the apply
that undid nothing (the optimizer's state copied into its tensors first, then loaded; no model copy), one rank
alone and as under a collective resume (the ranks agree after the steps, so a copy of the model is kept).

Usage::

    python scripts/bench_apply.py [--mib 128] [--repeat 5]

A model of ``--mib`` MiB of float32 parameters (Linear layers) with warm AdamW state resumes from a
memory-mapped file of itself; each variant runs ``--repeat`` times in a fresh process (spawn). Printed: the
median time of apply and the peak RssAnon growth during it (sampled every 1 ms from a thread), in MiB.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rss_anon_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))


def _build(mib: int):
    import torch

    width = 1024
    layers = max(1, mib * 2**20 // (4 * width * width))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(2, width)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def _old_apply(plan) -> None:
    """The apply before the transaction (dist_resume 0.3 until this change), model and optimizer parts."""
    from dist_resume._checkpoint.inplace import detach_from_file, into_live_state, storage_ptrs
    from dist_resume._state.optim import optimizer_to

    live = plan.objects
    live.model.load_state_dict(plan.model_state, strict=plan.strict)
    live.optimizer.load_state_dict(into_live_state(live.optimizer, plan.optimizer_state))
    if plan.mmapped:
        detach_from_file(live.optimizer, storage_ptrs(plan.parts.optimizer))
    optimizer_to(live.optimizer)


def _one(variant: str, path: str, mib: int, out: mp.Queue) -> None:  # type: ignore[type-arg]
    import torch

    import dist_resume as dr
    from dist_resume._checkpoint.objects import LiveObjects
    from dist_resume._checkpoint.restore import _plan
    from dist_resume._source.read import read_source
    from dist_resume._source.source import local_source

    torch.set_num_threads(1)
    model, opt = _build(mib)
    model.apply(lambda m: torch.nn.init.zeros_(m.weight) if isinstance(m, torch.nn.Linear) else None)
    options = dr.ResumeOptions(rng=False)
    contents = read_source(local_source(path), map_location="cpu", mmap=True)
    plan = _plan(contents, LiveObjects(model, opt), options)
    start_kib, peak = _rss_anon_kib(), [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_anon_kib())
            time.sleep(0.001)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    t0 = time.perf_counter()
    if variant == "before":
        _old_apply(plan)
    elif variant == "after":
        plan.apply()
    else:  # as under a collective resume, whose ranks agree after the steps: the model's copy is kept
        plan.apply(agree=lambda error: None)
    elapsed = time.perf_counter() - t0
    done.set()
    thread.join()
    peak[0] = max(peak[0], _rss_anon_kib())
    out.put((elapsed, (peak[0] - start_kib) / 1024))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    import dist_resume as dr

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        model, opt = _build(args.mib)
        path = str(dr.save_checkpoint(Path(tmp) / "c.pt", model=model, optimizer=opt, step=1, rng=False))
        del model, opt
        print(f"model {args.mib} MiB float32 + AdamW state (2x), file mapped; median of {args.repeat} runs")
        for variant in ("before", "after", "after, collective"):
            runs = []
            for _ in range(args.repeat):
                q = ctx.Queue()
                p = ctx.Process(target=_one, args=(variant, path, args.mib, q))
                p.start()
                runs.append(q.get(timeout=300))
                p.join()
            t = statistics.median(r[0] for r in runs)
            m = statistics.median(r[1] for r in runs)
            print(f"{variant:>17}: apply {t * 1000:7.1f} ms, peak RssAnon growth {m:7.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
