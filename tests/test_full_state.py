"""dist_resume._save.full_state outside torch.distributed: a streaming, atomic torch.save."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dist_resume._save.full_state import save_full_state
from dist_resume.errors import CheckpointWriteError


def test_one_process_writes_the_file_atomically_and_it_loads(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1}
    assert save_full_state(tmp_path / "full.pt", state) == tmp_path / "full.pt"
    loaded = torch.load(tmp_path / "full.pt", weights_only=True)
    assert loaded["step"] == 1 and torch.equal(loaded["model"]["weight"], model.weight.detach())
    assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg"], opt.state[model.weight]["exp_avg"])
    assert [p.name for p in tmp_path.iterdir()] == ["full.pt"]  # no temporary file left


def test_a_missing_folder_and_a_bad_bucket_are_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointWriteError, match="does not exist"):
        save_full_state(tmp_path / "no" / "full.pt", {"w": torch.ones(2)})
    with pytest.raises(ValueError, match="bucket_bytes must be positive"):
        save_full_state(tmp_path / "full.pt", {"w": torch.ones(2)}, bucket_bytes=0)
