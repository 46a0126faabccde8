"""docs/cli.md's ``$ dist-resume`` examples are what the CLI prints: each is rebuilt from its files and compared
line by line (sizes, dates and versions are wildcards; a line the page cuts with ``...`` matches its start)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch

import dist_resume
from dist_resume.cli import main

PAGE = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
# what changes from run to run or machine to machine: sizes, the save time, versions
VOLATILE = [
    (r"\d+(?:\\\.\d+)?\\ (B|KiB|MiB)", r"[\\d.]+\\ \1"),
    (r"\d{4}\\-\d\d\\-\d\d\\ \d\d:\d\d:\d\d\\ UTC", r"\\d{4}-\\d\\d-\\d\\d \\d\\d:\\d\\d:\\d\\d UTC"),
    (r"torch_version=\S+?\\ ", r"torch_version=\\S+ "),
    (r"dist_resume_version=\S+?\\ ", r"dist_resume_version=\\S+ "),
]
# the examples checked here; the HF Trainer and DCP ones need transformers / DCP output (tests/interop covers them)
CHECKED = [
    "inspect ckpt_30.pt",
    "inspect snapshot.pt",
    "verify snapshot.pt ckpt_30.pt",
    "verify ckpt_30.pt ckpt_31.pt",
]


def examples() -> dict[str, list[str]]:
    """Each ``$ dist-resume ARGS`` line of the page (comment dropped) with the output lines under it."""
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in PAGE.read_text().splitlines():
        command = re.match(r"^\s+\$ dist-resume (.*?)(\s+#.*)?$", line)
        if command:
            current = found.setdefault(command.group(1), [])
        elif current is not None and line.startswith("      ") and line.strip():
            current.append(line.strip())
        else:
            current = None
    return found


def _pattern(doc_line: str) -> re.Pattern[str]:
    cut = doc_line.endswith("...") and not doc_line.endswith(": ...")
    text = re.escape(doc_line.removesuffix("...").rstrip() if cut else doc_line)
    for volatile, wildcard in VOLATILE:
        text = re.sub(volatile, wildcard, text)
    return re.compile(text + (".*" if cut else "") + r"\s*$")


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The page's files: an AdamW run of a Linear(4, 3) saved at step 30, epoch 3; the same weights as PyTorch's
    torchrun tutorial snapshot; step 31 (one bias value moved, a scheduler built: groups gain initial_lr)."""
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    dist_resume.save_checkpoint("ckpt_30.pt", model=model, optimizer=opt, step=30, epoch=3, rng=True)
    torch.save({"MODEL_STATE": model.state_dict(), "EPOCHS_RUN": 3}, "snapshot.pt")
    with torch.no_grad():
        model.bias[0] += 3.1e-4
    torch.optim.lr_scheduler.StepLR(opt, step_size=10)
    dist_resume.save_checkpoint("ckpt_31.pt", model=model, optimizer=opt, step=31, epoch=3, rng=True)
    return tmp_path


def test_every_checked_example_is_on_the_page() -> None:
    assert set(CHECKED) <= set(examples()), sorted(examples())


@pytest.mark.parametrize("command", CHECKED)
def test_the_example_is_what_the_cli_prints(files: Path, command: str, capsys: pytest.CaptureFixture[str]) -> None:
    main(shlex.split(command))
    printed = capsys.readouterr().out.splitlines()
    doc = [line for line in examples()[command] if line != "..."]
    unmatched = [line for line in doc if not any(_pattern(line).match(p.strip()) for p in printed)]
    assert unmatched == [], "docs/cli.md says:\n" + "\n".join(unmatched) + "\n\nthe CLI printed:\n" + "\n".join(printed)
