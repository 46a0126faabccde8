"""Apply as one transaction: the steps that can fail, each able to put back what it changed, then the commit.

``transaction``: :func:`apply_plan` and :func:`run_transaction` (the steps, the ranks' agreement, the commit);
``step``: what a step is and what it sees of the plan; ``steps``: the small states' steps, in order;
``optimizer_step``: the optimizer's load on its own state tensors; ``module_step``: a module whose own load can raise;
``inplace``: the data written into the live tensors. Nothing here imports the plan (:mod:`..plan` imports this).
"""
