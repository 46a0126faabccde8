"""Run by tests/interop/test_multiprocess.py under torchrun: resume foreign folders into a DDP model on every rank.

argv: the HF Trainer checkpoint folder, the DCP folder, a torch file with the expected state. Each rank
resumes each folder twice (every rank reads it; rank 0 reads and broadcasts) and prints one line,
``RESULT {"rank": r, "checks": {name: problem or null}}``.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import dist_resume
from tests.interop.conftest import _tiny


def _bert(folder: str) -> nn.Module:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig.from_pretrained(folder))


def _hf_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if "bias" not in n and "LayerNorm" not in n]
    rest = [p for n, p in model.named_parameters() if "bias" in n or "LayerNorm" in n]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}])


def _problem(got: Any, want: Any, where: str) -> str | None:
    if isinstance(want, torch.Tensor):
        ok = isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got.cpu(), want)
        return None if ok else f"{where} differs"
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return f"{where}: keys differ"
        return next((p for k in want if (p := _problem(got[k], want[k], f"{where}[{k!r}]"))), None)
    return None if got == want else f"{where}: {got!r} != {want!r}"


def _check(name: str, path: str, expected: dict[str, Any], broadcast: bool) -> str | None:
    torch.manual_seed(100 + dist_resume.rank_info().rank)  # every rank starts from different weights
    inner = _bert(path) if name == "hf" else _tiny()
    model = DDP(inner)
    opt = _hf_optimizer(model) if name == "hf" else torch.optim.AdamW(model.parameters(), lr=1e-2)
    result = dist_resume.resume(
        path, model=model, optimizer=opt, options=dist_resume.ResumeOptions(broadcast_from_rank0=broadcast)
    )
    want_layout = "hf-trainer" if name == "hf" else "dcp"
    if result.layout.value != want_layout or "optimizer" not in result.restored:
        return f"layout {result.layout.value}, restored {result.restored}"
    problem = _problem(dict(inner.state_dict()), expected["model"], "model") or _problem(
        opt.state_dict()["state"], expected["state"], "optimizer state"
    )
    if problem is None and not all(opt.state[p] for g in opt.param_groups for p in g["params"]):
        problem = "a parameter got no optimizer state"
    return problem


def main() -> None:
    hf, dcp, expected_path = sys.argv[1:4]
    info = dist_resume.init_distributed(backend="gloo", timeout=timedelta(seconds=60))
    expected = torch.load(expected_path, weights_only=True)
    checks: dict[str, str | None] = {}
    for name, path in (("hf", hf), ("dcp", dcp)):
        for broadcast in (False, True):
            key = f"{name}{'-broadcast' if broadcast else ''}"
            try:
                checks[key] = _check(name, path, expected[name], broadcast)
            except Exception as err:  # reported, not raised: the other checks still run
                checks[key] = f"{type(err).__name__}: {err}"
    line = "RESULT " + json.dumps({"rank": info.rank, "world_size": info.world_size, "checks": checks}) + "\n"
    sys.stdout.write(line)  # one write, line included: the ranks' lines never interleave
    sys.stdout.flush()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
