"""The test accelerator: simulated devices on the CPU (device type ``sim``) and a process-group backend for them.

Public as :mod:`dist_resume.testing.sim` (read its docstring); this package holds the implementation: ``build`` (the
C++ library, cached by content), ``activate`` (loading it, switching devices on and off), ``device_module``
(``torch.sim``), ``process_group`` (``simgloo``), ``boot`` (worker processes) and ``autoload`` (booting every
process of an environment that imports torch, from ``startup/sitecustomize.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

__all__ = ["DEVICE_TYPE", "sim_tags_note"]

DEVICE_TYPE: Final = "sim"  # the name PrivateUse1 gets


def sim_tags_note(tags: Iterable[str]) -> str | None:
    """What to say of a checkpoint whose storages carry the test accelerator's device tags (``sim:0``): where they
    come from and how to read it; None when no tag is one. Local; imports nothing."""
    found = sorted({t for t in tags if t == DEVICE_TYPE or t.startswith(f"{DEVICE_TYPE}:")})
    if not found:
        return None
    return (
        f"device tags {', '.join(found)} are the test accelerator's (simulated devices: dist_resume.testing.sim, e.g. "
        "`dist-resume check --device sim`); outside it plain torch.load fails (\"don't know how to restore data "
        'location"): load with map_location="cpu", dist_resume.load_checkpoint() or resume(), or call '
        "dist_resume.testing.sim.activate() first"
    )
