"""torchrun worker: every collective dist_resume uses, in a process where numpy cannot be imported.

torch's own object collectives decode through ``tensor.numpy()``; dist_resume's runtime dependency is torch only.
"""

from __future__ import annotations

import os
import sys

sys.modules["numpy"] = None  # type: ignore[assignment]  # before torch: as if numpy were not installed
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import dist_resume  # noqa: E402


def main() -> None:
    folder = sys.argv[1]
    info = dist_resume.init_distributed()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    manager = dist_resume.CheckpointManager(folder, keep_last=1)
    manager.save(1, model=model, optimizer=opt)  # run_on_rank0 + RNG gather
    manager.save_async(2, model=model, optimizer=opt).wait()
    fresh = torch.nn.Linear(4, 3)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    by_folder = dist_resume.resume(
        folder, model=fresh, optimizer=fresh_opt, options=dist_resume.ResumeOptions(rng=True)
    )  # rank agreement
    by_broadcast = dist_resume.resume(
        folder, model=fresh, optimizer=fresh_opt, options=dist_resume.ResumeOptions(broadcast_from_rank0=True)
    )
    assert torch.equal(fresh.weight, model.weight)
    sys.stdout.write(f"OK rank={info.rank} steps={by_folder.step},{by_broadcast.step}\n")
    sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
