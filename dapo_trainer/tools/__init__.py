"""Diagnostics around a training run, each a console script or read by one.

* :mod:`.report` (``dapo-report``): an HTML page of plots from a run's ``metrics.jsonl``;
* :mod:`.batch_quality`: the trainer's rollout dumps and the report's batch-quality section;
* :mod:`.profiler` (``dapo-profile``): where a step's time goes, with findings;
* :mod:`.tune` (``dapo-tune``): a config for a task, a machine and a model;
* :mod:`.memory_model`: the per-device memory ``dapo-tune`` plans with.

Nothing is imported here: the trainer imports :mod:`.batch_quality` and :mod:`.profiler` imports the
trainer, so eager imports would make a cycle.
"""
