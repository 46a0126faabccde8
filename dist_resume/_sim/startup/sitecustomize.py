"""Imported by Python's ``site`` at start-up when this folder is on ``PYTHONPATH`` (``dist-resume check --device
sim``): the test accelerator boots when the process imports torch. See ``dist_resume._sim.autoload``."""

from dist_resume._sim.autoload import install

install(__file__)
