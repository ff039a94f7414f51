"""Planning a run before it starts: the cost and memory estimate (``planner.py``, ``planner_moe.py``:
:func:`~titanlite.plan.planner.estimate_run`), the steps and seq_len stages of a token budget (``run_plan.py``:
:func:`~titanlite.plan.run_plan.plan_steps`) and the dry run at full scale (``dry_run.py``). Above ``models`` and
``parallel``: it imports their FLOPs, parameter counts and pipeline arithmetic, never the reverse."""
