"""The tools behind the ``dist-resume`` command, as functions: inspect, verify, convert, find checkpoints, devices.

A training script rarely needs them (``dist_resume`` holds what it does); a notebook, a test or a job
script checking a folder before it launches does. Each is local unless its docstring says collective.

Example::

    >>> path = dist_resume.save_checkpoint("ckpt.pt", model=torch.nn.Linear(2, 2), step=3)
    >>> from dist_resume import tools
    >>> tools.inspect_checkpoint(path).step, tools.verify_archive(path)
    (3, [])
"""

from __future__ import annotations

from ._convert.convert import ConvertResult, KeyForm, convert_checkpoint
from ._convert.formats import ConvertFormat
from ._core.location import RemotePath, RemoteStat
from ._core.publish import publish
from ._format.zip_verify import ArchiveFinding, FindingKind
from ._manager.adopt import FolderConvertResult, convert_into_folder
from ._source.consensus import resolve_checkpoint
from ._source.integrity import CheckpointInfo, inspect_checkpoint, verify_archive
from ._source.listing import latest_checkpoint
from ._state.devices import device_report

__all__ = [
    # checkpoint folders
    "latest_checkpoint",
    "resolve_checkpoint",
    "RemotePath",
    "RemoteStat",
    # integrity (dist-resume inspect, verify)
    "inspect_checkpoint",
    "CheckpointInfo",
    "verify_archive",
    "ArchiveFinding",
    "FindingKind",
    # conversion (dist-resume convert)
    "convert_checkpoint",
    "ConvertResult",
    "KeyForm",
    "ConvertFormat",
    "convert_into_folder",
    "FolderConvertResult",
    # devices
    "device_report",
]

publish(globals(), __all__, __name__)

del publish
