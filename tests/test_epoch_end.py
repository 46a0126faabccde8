"""A save right after an epoch's last batch is written once the loop has done what it does at an epoch's end.

torchvision's reference loop steps its scheduler (and evaluates) after the batch loop: a checkpoint written at the
epoch's last batch would resume in the next epoch without that step. The manager holds such a save until the loop
starts the next epoch (or the next save of that step, or close()): a run killed in between resumes from the
checkpoint before and ends exact; the checkpoint, once written, holds the scheduler after its step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import dist_resume
from dist_resume import ResumableDistributedSampler as Sampler

BATCHES, EPOCHS = 4, 3


def _objects(workers: int = 0) -> tuple[Any, ...]:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(BATCHES * 2, 3))
    loader = DataLoader(data, batch_size=2, sampler=Sampler(data, num_replicas=1, rank=0), num_workers=workers)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return loader, model, opt, sched


def _run(folder: Path, *, every: int, die_at: int | None = None, peek: bool = False, workers: int = 0) -> list[float]:
    """torchvision's shape: a save every ``every`` steps in the batch loop, the scheduler stepped after it, a save at
    the epoch's end. ``die_at``: the process "dies" right after that step's save (no close(): nothing more written).
    Returns the lr of every step trained."""
    loader, model, opt, sched = _objects(workers)
    mgr = dist_resume.CheckpointManager(folder, model=model, optimizer=opt, scheduler=sched, dataloader=loader)
    res = mgr.resume()
    step, lrs = (res.step or 0, []) if res is not None else (0, [])
    for epoch in range((res.epoch or 0) if res is not None else 0, EPOCHS):
        if peek:
            next(iter(loader))  # PyTorch's DDP tutorial
        loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        for (x,) in loader:
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            lrs.append(opt.param_groups[0]["lr"])
            if step % every == 0:
                mgr.save(step)
            if step == die_at:
                return lrs  # killed: the manager is never closed
        sched.step()
        mgr.save(step)
    mgr.close()
    return lrs


@pytest.mark.parametrize("peek", [False, True], ids=["torchvision", "tutorial's peek"])
def test_a_run_killed_right_after_a_save_at_an_epochs_last_batch_resumes_exactly(tmp_path, peek):
    reference = _run(tmp_path / "ref", every=2, peek=peek)
    assert reference == [1.0] * 4 + [0.5] * 4 + [0.25] * 4
    killed = _run(tmp_path / "run", every=2, die_at=4, peek=peek)  # step 4: epoch 0's last batch
    assert not (tmp_path / "run" / "ckpt_00000004.pt").exists()  # held: the epoch's end never came
    rerun = _run(tmp_path / "run", every=2, peek=peek)  # from step 2: steps 3 and 4 again, then the rest
    assert len(rerun) == 10 and killed[:2] + rerun == reference


def test_the_held_save_is_written_as_the_next_epoch_starts_with_the_scheduler_stepped(tmp_path):
    loader, model, opt, sched = _objects()
    with dist_resume.CheckpointManager(tmp_path, model=model, optimizer=opt, scheduler=sched, dataloader=loader) as mgr:
        batches = iter(loader)
        for _ in range(BATCHES):
            next(batches)
        path = mgr.save(BATCHES)  # the epoch's last batch
        assert path.name == "ckpt_00000004.pt" and not path.exists()
        with pytest.raises(StopIteration):
            next(batches)
        opt.step()
        sched.step()  # the epoch's own end
        batches = iter(loader)  # the next epoch starts: written now
        saved = torch.load(path, weights_only=True)
        assert saved["scheduler"]["last_epoch"] == 1 and saved["optimizer"]["param_groups"][0]["lr"] == 0.5
        assert (saved["sampler"]["epoch"], saved["sampler"]["consumed"]) == (1, 0)
        next(batches), next(batches)
        mgr.save(BATCHES + 2)  # mid-epoch: written at once
        assert (tmp_path / "ckpt_00000006.pt").exists()


def test_close_writes_a_held_save_and_a_later_step_drops_it(tmp_path):
    loader, model, opt, sched = _objects(workers=2)
    mgr = dist_resume.CheckpointManager(tmp_path, model=model, optimizer=opt, scheduler=sched, dataloader=loader)
    for _ in loader:
        pass
    mgr.save(4)
    mgr.save(5)  # another step with no new epoch begun: the held save is no longer the state of step 4
    assert not (tmp_path / "ckpt_00000004.pt").exists()
    mgr.close()
    assert (tmp_path / "ckpt_00000005.pt").exists()


def test_a_run_that_returns_with_a_save_held_frees_its_loader_and_workers_at_once(tmp_path):
    """Kept until a garbage collection (the hook waiting for the next iterator held the manager's loader position,
    which holds the loader), the loader's persistent workers would make torch's shutdown wait 5 s each."""
    import gc
    import weakref

    gc.disable()
    try:
        loader, model, opt, sched = _objects()
        loader = DataLoader(
            loader.dataset, batch_size=2, sampler=loader.sampler, num_workers=2, persistent_workers=True
        )
        mgr = dist_resume.CheckpointManager(tmp_path, model=model, optimizer=opt, scheduler=sched, dataloader=loader)
        for _ in loader:
            pass
        mgr.save(BATCHES)  # held until the next epoch: the run returns first, as a killed one would
        assert not (tmp_path / "ckpt_00000004.pt").exists()
        gone, workers = weakref.ref(loader), list(loader._iterator._workers)  # type: ignore[union-attr]
        del loader, mgr
        assert gone() is None, "the loader is kept alive by a reference cycle"
        for worker in workers:
            worker.join(timeout=2)
        assert [w.exitcode for w in workers] == [0, 0]
    finally:
        gc.enable()
