"""The restore plan: every part of a checkpoint validated against the live objects before anything changes.

``restore_plan``: :class:`RestorePlan` and :func:`plan_restore`; ``model_fit``: the model's state re-keyed to the live
model, or why it does not fit; ``hparams``: whose optimizer hyperparameters win and what differs; ``ema``: EMA weights.
"""
