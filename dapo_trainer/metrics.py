"""Where the metrics go: ``metrics.jsonl``, a tqdm progress bar, TensorBoard when installed.

Every line of ``metrics.jsonl`` is one JSON object with ``"step"`` and float metrics
(names in ``dapo_trainer/CONTRACT.md``; a string value such as ``actor/skip_reason`` is
written as is). On resume the file is cut back to the resumed step, and a run that starts
from step 0 starts it empty, so a step that crashed before its checkpoint (step 0's
validation included) is never listed twice.
"""
from __future__ import annotations

import json
import os
import time
from typing import Dict, List, Optional

from tqdm import tqdm

METRICS_FILE = "metrics.jsonl"


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
    """Appends step metrics to ``metrics.jsonl``, mirrors them to TensorBoard, drives the bar.

    Only rank 0 writes (``enabled=False`` elsewhere).
    """

    def __init__(self, run_dir: str, total_steps: int, *, start_step: int = 0, enabled: bool = True,
                 progress_bar: bool = True, tensorboard: bool = True):
        self.enabled = enabled
        self.path = os.path.join(run_dir, METRICS_FILE)
        self.tb = None
        self.bar = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        # Drop lines of steps after the checkpoint we resume from: they are recomputed. From
        # step 0 nothing is kept: the validation before training is rerun and logs step 0.
        kept = [m for m in read_metrics(run_dir) if m.get("step", 0) <= start_step] if start_step > 0 else []
        # Written with the first line: a run that fails before logging leaves the old file as it was.
        self._head: Optional[str] = "".join(json.dumps(m) + "\n" for m in kept)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))
            except ImportError:  # tensorboard is optional
                self.tb = None
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
        if self.tb is not None:
            for k, v in metrics.items():
                if not isinstance(v, str):
                    self.tb.add_scalar(k, float(v), step)

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

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()


def mean(values) -> Optional[float]:
    values = list(values)
    return sum(values) / len(values) if values else None
