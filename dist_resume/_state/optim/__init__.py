"""Optimizer state: how it is keyed, matched to the live parameters, checked per class, placed, and sharded.

One concept per module: ``keys`` (the forms other tools write re-keyed; state that fits no parameter refused),
``match`` (saved state paired with live parameters, group by group or by name), ``per_class`` (each entry has what its
optimizer's ``step()`` reads), ``prepare`` (the canonical names a save writes; saved state prepared for a live
optimizer's ``load_state_dict``), ``placement`` (state on its parameters' devices: ``optimizer_to``), ``sharded``
(state for FSDP2 parameters: each rank keeps its boxes).
"""
