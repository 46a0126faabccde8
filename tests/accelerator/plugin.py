"""``dist_resume.testing.sim.plugin`` under its former name: importing it boots the test accelerator."""

from dist_resume.testing.sim.plugin import DEVICE

__all__ = ["DEVICE"]
