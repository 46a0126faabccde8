"""First lines of a torchrun worker that runs on the test accelerator: ``dist_resume.testing.sim.boot``."""

from dist_resume.testing.sim import boot

__all__ = ["boot"]
