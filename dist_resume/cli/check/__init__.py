"""``dist-resume check``: does a training command resume exactly? The engine of ``dist_resume.testing.check_resume``.

One concept per module, in the order a check uses them:

- ``_command``: the command itself, :class:`CheckOptions`, the reference run and the interrupted one
  (:func:`run_check`, :func:`main_check`);
- ``_watch``: what the check sees of a checkpoint folder while a run writes it (:class:`FolderWatch`);
- ``_launch``: one launch of the command, watched and stopped as a preemption stops a job (:class:`Launch`);
- ``_compare``: which checkpoints of the two runs to pair, and how a pair differs, part by part;
- ``_mask``: the run's own folder in saved strings, compared as ``<run folder>``;
- ``_streams``: how far apart two runs' RNG streams are, in draws;
- ``_evidence``: what the diagnosis reads;
- ``_diagnose``: the known causes of a difference; ``_diagnose_resume``: those read at the first checkpoint written
  after a resume;
- ``_result``: what the check found (:class:`ResumeCheck`);
- ``_verdict``: the pairs compared, the first difference and the diagnosis assembled into a :class:`ResumeCheck`.

Importing this package imports no torch: the comparison and the verdict are imported while the command runs.
"""

from __future__ import annotations

from ._command import CheckOptions, main_check, run_check
from ._launch import Launch, Seen, StopSignal
from ._result import Cause, HyperparameterDifference, PartDifference, ResumeCheck, StepDifference

__all__ = [
    "CheckOptions",
    "run_check",
    "main_check",
    "Launch",
    "Seen",
    "StopSignal",
    "Cause",
    "HyperparameterDifference",
    "PartDifference",
    "ResumeCheck",
    "StepDifference",
]
