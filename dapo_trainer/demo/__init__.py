"""The built-in demo: a tiny model learning a generated digit task with DAPO on a CPU.

``python -m dapo_trainer.demo`` (``make demo``) is the project's main job; ``python -m
dapo_trainer.demo.ablation`` (``make ablation``) shows what each DAPO component is for, on a
family of sorting tasks built from the same pieces (:func:`build_demo`'s warm start).
:func:`run_demo` runs the demo.
"""
from __future__ import annotations

import os
import warnings
from typing import List, Optional, Sequence

from .. import metrics
from .arithmetic import TaskConfig
from .assets import FAMILIES, DemoAssets, DemoConfig, build_demo

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "demo.yaml")
DIALOG_CONFIG = os.path.join(os.path.dirname(DEFAULT_CONFIG), "dialog_demo.yaml")

__all__ = ["run_demo", "check_config", "DEFAULT_CONFIG", "read_metrics", "DemoConfig", "TaskConfig", "build_demo",
           "DemoAssets"]


def read_metrics(run_dir: str) -> List[dict]:
    """The rows of ``run_dir/metrics.jsonl`` (one JSON object per logged step); unlike
    :func:`dapo_trainer.metrics.read_metrics`, a missing file is an error here."""
    if not os.path.isfile(os.path.join(run_dir, metrics.METRICS_FILE)):
        raise ValueError(f"{run_dir!r} has no {metrics.METRICS_FILE}; is it a trainer run directory?")
    return metrics.read_metrics(run_dir)


def _run_overrides(run_dir: str, seed: int, overrides: Sequence[str]) -> List[str]:
    """The trainer overrides of a demo run but the assets' paths (the user's last: they win)."""
    return [f"trainer.default_local_dir={run_dir}", f"trainer.seed={seed}", *overrides]


def check_config(config: Optional[str] = DEFAULT_CONFIG, run_dir: str = "runs/demo/seed0", seed: int = 0,
                 overrides: Sequence[str] = ()) -> None:
    """Load the demo's trainer config without its assets, so that a bad override is an error (naming
    its key) before the warm start is built or the run directory touched."""
    from ..config import VerlKeysNoted, load_config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", VerlKeysNoted)  # noted once, by run_demo's load
        load_config(config, _run_overrides(run_dir, seed, overrides))


def run_demo(seed: int = 0, config: Optional[str] = DEFAULT_CONFIG, cache_dir: str = ".cache/dapo_demo",
             run_dir: str = "runs/demo/seed0", overrides: Sequence[str] = (),
             demo_config=None, progress: bool = True, task: str = "sort") -> dict:
    """Warm-start (cached) and train with DAPO; returns before/after held-out accuracy.

    Returns ``{"before", "after", "metrics" (the trainer's last step), "assets", "built"}``;
    ``before`` is the greedy held-out accuracy at step 0, ``after`` at the last step.
    ``config``: the trainer YAML (default ``configs/demo.yaml``); ``overrides`` win over it.
    """
    from ..config import load_config
    from ..trainer import DAPOTrainer

    check_config(config, run_dir, seed, overrides)
    if task == "dialog":  # the order-status desk (demo/dialog.py)
        from .dialog import DialogDemoConfig, build_dialog_demo

        assets = build_dialog_demo(demo_config or DialogDemoConfig(seed=seed), cache_dir=cache_dir, progress=progress)
    elif task == "sort":
        assets = build_demo(demo_config or DemoConfig(seed=seed), cache_dir=cache_dir, progress=progress)
    else:
        raise ValueError(f"task must be 'sort' or 'dialog', got {task!r}")
    # Prompt sharing is for dense models (its config rule): a family with experts computes every copy.
    experts = FAMILIES[getattr(demo_config, "family", "llama")].get("num_experts")
    moe = ["actor_rollout_ref.actor.share_prompts=false"] if experts else []
    cfg = load_config(config, [
        f"actor_rollout_ref.model.path={assets.model_dir}",
        f"data.train_files=[{assets.train_file}]",
        f"data.val_files=[{assets.val_file}]",
        *moe,
        *_run_overrides(run_dir, seed, overrides),
    ])
    final = DAPOTrainer(cfg).fit()
    val = [m for m in read_metrics(run_dir) if "val/acc" in m]
    if not val:
        raise ValueError("the run logged no validation; keep data.val_files and trainer.val_before_train set")
    return {"before": val[0]["val/acc"] if val[0]["step"] == 0 else float("nan"),
            "after": val[-1]["val/acc"], "metrics": final, "assets": assets, "built": assets.built}
