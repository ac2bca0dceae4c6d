"""Diagnostics around a training run, each a console script or read by one. They sit above the
trainer: they may import it, nothing outside ``tools/`` and the demos imports them.

* :mod:`.report` (``dapo-report``): an HTML page of plots from a run's ``metrics.jsonl``;
* :mod:`.batch_quality`: the report's batch-quality section, read from the trainer's rollout dumps
  (written by :mod:`dapo_trainer.rollout_dump`);
* :mod:`.profiler` (``dapo-profile``): where a step's time goes, with findings;
* :mod:`.tune` (``dapo-tune``): a config for a task, a machine and a model, planned with the
  per-device memory of :mod:`dapo_trainer.memory_model`.

Nothing is imported here, so a console script loads only its own module.
"""
