"""Where the metrics go: ``metrics.jsonl``, a tqdm progress bar, the trackers of ``trainer.logger``.

Every line of ``metrics.jsonl`` is one JSON object with ``"step"`` and float metrics
(names in ``dapo_trainer/CONTRACT.md``; a string value such as ``actor/skip_reason`` is
written as is). On resume the file is cut back to the resumed step, and a run that starts
from step 0 starts it empty, so a step that crashed before its checkpoint (step 0's
validation included) is never listed twice. The trackers (TensorBoard, wandb, mlflow:
:mod:`.loggers`) get each step's numeric metrics under the same keys.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import Dict, List, Optional, Sequence

from tqdm import tqdm

from .loggers import Logger, RunInfo, open_loggers

METRICS_FILE = "metrics.jsonl"
logger = logging.getLogger(__name__)


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_metrics(run_dir: str) -> List[dict]:
    """All lines of ``run_dir/metrics.jsonl`` (an empty list when there is none)."""
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class MetricsLogger:
    """Appends step metrics to ``metrics.jsonl``, hands them to the trackers, drives the bar.

    Only rank 0 writes (``enabled=False`` elsewhere). ``loggers``: ``trainer.logger``'s names;
    ``run``: what the trackers are opened with (its ``resume`` is ``start_step > 0``).
    """

    def __init__(self, run_dir: str, total_steps: int, *, start_step: int = 0, enabled: bool = True,
                 progress_bar: bool = True, loggers: Sequence[str] = ("tensorboard",),
                 run: Optional[RunInfo] = None):
        self.enabled = enabled
        self.path = os.path.join(run_dir, METRICS_FILE)
        self.trackers: List[Logger] = []
        self.bar = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        # Drop lines of steps after the checkpoint we resume from: they are recomputed. From
        # step 0 nothing is kept: the validation before training is rerun and logs step 0.
        kept = [m for m in read_metrics(run_dir) if m.get("step", 0) <= start_step] if start_step > 0 else []
        # Written with the first line: a run that fails before logging leaves the old file as it was.
        self._head: Optional[str] = "".join(json.dumps(m) + "\n" for m in kept)
        run = dataclasses.replace(run or RunInfo(run_dir), run_dir=run_dir, resume=start_step > 0)
        self.trackers = open_loggers(loggers, run)
        if progress_bar:
            self.bar = tqdm(total=total_steps, initial=start_step, desc="DAPO", unit="step", dynamic_ncols=True)
        self._t0 = time.perf_counter()

    def log(self, step: int, metrics: Dict[str, float]) -> None:
        if not self.enabled:
            return
        line = {"step": step, **{k: v if isinstance(v, str) else float(v) for k, v in metrics.items()}}
        if self._head is not None:
            _atomic_write_text(self.path, self._head)
            self._head = None
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")
            f.flush()
            os.fsync(f.fileno())
        numbers = {k: v for k, v in line.items() if k != "step" and not isinstance(v, str)}
        for tracker in self.trackers:
            tracker.log(numbers, step)

    def progress(self, step: int, metrics: Dict[str, float]) -> None:
        """Advance the bar to ``step`` with the headline numbers (tqdm adds the ETA)."""
        if self.bar is None:
            return
        show = {"reward": "critic/rewards/mean", "acc": "acc/mean", "keep": "train/keep_rate",
                "gen": "train/num_gen_batches", "tok/s": "perf/tokens_per_s", "val": "val/acc"}
        post = {}
        for name, key in show.items():
            if key in metrics:
                v = metrics[key]
                post[name] = f"{v:.0f}" if name in ("gen", "tok/s") else f"{v:.3f}"
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(step - self.bar.n)

    def close(self, failed: bool = False) -> None:
        """Close the bar and every tracker, each even if another one's close raises. ``failed``:
        training raised, and a tracker's error here is a warning (the training error is the one that
        propagates); otherwise the first such error is raised after all are closed."""
        if self.bar is not None:
            self.bar.close()
        trackers, self.trackers = self.trackers, []
        error = None
        for tracker in trackers:
            try:
                tracker.close(failed=failed)
            except Exception as e:
                if failed:
                    logger.warning("closing %s failed: %s", type(tracker).__name__, e)
                error = error or e
        if error is not None and not failed:
            raise error


def mean(values) -> Optional[float]:
    values = list(values)
    return sum(values) / len(values) if values else None
