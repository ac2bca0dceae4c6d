"""Experiment trackers behind ``trainer.logger``, under verl's names.

``metrics.jsonl`` is always written (:mod:`.metrics`); each name in ``trainer.logger`` adds a
tracker that gets every step's numeric metrics under the same keys, at the same step:

* ``console``: nothing more (the progress bar is ``trainer.progress_bar``);
* ``tensorboard``: ``<run_dir>/tensorboard`` (torch's ``SummaryWriter``). It is in the default
  list, so without the ``tensorboard`` package a run goes on without it, with a warning;
* ``wandb``: ``wandb.init(project=trainer.project_name, name=trainer.experiment_name,
  dir=<run_dir>, config=<the resolved config>)``, as verl calls it; ``WANDB_MODE=offline`` keeps the
  run on disk (``<run_dir>/wandb/offline-run-*``, ``wandb sync`` uploads it later);
* ``mlflow``: an ``MlflowClient`` at ``MLFLOW_TRACKING_URI``, else a file store
  ``file://<run_dir>/mlruns`` (mlflow 3 calls file stores "maintenance mode": the trainer sets
  ``MLFLOW_ALLOW_FILE_STORE=true`` for one unless it is set). Experiment ``trainer.project_name``,
  run ``trainer.experiment_name``, params the config's dotted keys (``trainer.seed``). Metric names
  mlflow refuses are renamed: ``@`` -> ``_at_`` as verl does, any other character outside
  ``[/\\w.\\- :]`` -> ``_`` (no name of CONTRACT.md is renamed).

A requested tracker whose package is missing is an ImportError naming ``trainer.logger`` and the
package to install, raised by :func:`check_installed` at start-up (``DAPOTrainer`` calls it
before it builds anything). String metrics (``actor/skip_reason``) stay in ``metrics.jsonl``
only: :mod:`.metrics` hands trackers the numeric ones.

Resume: wandb and mlflow store their run id in the run directory (``wandb_run_id``,
``mlflow_run_id``); a run resumed from a checkpoint continues that tracker run, a run from step 0
starts a new one. Steps logged after the checkpoint before a crash are logged again (wandb drops a
step it already has; mlflow keeps both values). Trackers are closed at the end of training, and
marked failed when training raised (wandb exit code 1, mlflow status ``FAILED``).
"""
from __future__ import annotations

import importlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Protocol, Sequence
from urllib.parse import urlparse

log = logging.getLogger(__name__)


class Logger(Protocol):
    """One tracker: ``log`` a step's metrics, ``close`` at the end (``failed``: training raised)."""

    def log(self, metrics: Dict[str, float], step: int) -> None: ...

    def close(self, failed: bool = False) -> None: ...


@dataclass(frozen=True)
class RunInfo:
    """What a tracker is opened with."""

    run_dir: str
    project: str = "dapo"  # trainer.project_name
    experiment: str = "run"  # trainer.experiment_name
    config: dict = field(default_factory=dict)  # the resolved config, nested (Config.to_dict())
    resume: bool = False  # resumed from a checkpoint: continue the tracker run whose id run_dir holds


def _stored_id(run: RunInfo, name: str) -> Optional[str]:
    """The tracker run id ``run_dir/name`` holds, when this run resumes (else None: a new run)."""
    path = os.path.join(run.run_dir, name)
    if not run.resume or not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read().strip() or None


def _store_id(run: RunInfo, name: str, run_id: str) -> None:
    with open(os.path.join(run.run_dir, name), "w") as f:
        f.write(run_id + "\n")


class TensorBoardLogger:
    """Scalars under ``run_dir/tensorboard``."""

    def __init__(self, run: RunInfo):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(os.path.join(run.run_dir, "tensorboard"))

    def log(self, metrics: Dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class WandbLogger:
    """A wandb run under ``run_dir/wandb``, its id kept in ``run_dir/wandb_run_id``."""

    ID_FILE = "wandb_run_id"

    def __init__(self, run: RunInfo):
        import wandb

        self.run = wandb.init(project=run.project, name=run.experiment, dir=run.run_dir, config=run.config,
                              id=_stored_id(run, self.ID_FILE), resume="allow")
        _store_id(run, self.ID_FILE, self.run.id)

    def log(self, metrics: Dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


_MLFLOW_BAD_CHAR = re.compile(r"[^/\w.\- :]")


def mlflow_key(name: str) -> str:
    """``name`` as an mlflow metric name (unchanged for every name in CONTRACT.md)."""
    return _MLFLOW_BAD_CHAR.sub("_", name.replace("@", "_at_"))


def flat_params(config: dict, prefix: str = "") -> Dict[str, str]:
    """The nested config as ``{dotted key: value}``; non-str values as JSON (``true``, ``null``, lists)."""
    out: Dict[str, str] = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flat_params(v, key + "."))
        else:
            out[key] = v if isinstance(v, str) else json.dumps(v)
    return out


def mlflow_tracking_uri(run_dir: str) -> str:
    """``MLFLOW_TRACKING_URI``, else the file store ``run_dir/mlruns``."""
    return os.environ.get("MLFLOW_TRACKING_URI") or Path(run_dir, "mlruns").resolve().as_uri()


class MlflowLogger:
    """An mlflow run (:func:`mlflow_tracking_uri`), its id kept in ``run_dir/mlflow_run_id``."""

    ID_FILE = "mlflow_run_id"
    _MAX_VALUE = 6000  # mlflow's param value length (longer ones are cut by mlflow)

    def __init__(self, run: RunInfo):
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        uri = mlflow_tracking_uri(run.run_dir)
        if urlparse(uri).scheme in ("", "file"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(uri)
        self.run_id = _stored_id(run, self.ID_FILE)
        logged: Dict[str, str] = {}
        if self.run_id is not None:
            try:
                logged = self.client.get_run(self.run_id).data.params
                self.client.update_run(self.run_id, status="RUNNING")
            except MlflowException as e:
                log.warning("mlflow: the run %s of %s cannot be continued (%s); starting a new one",
                            self.run_id, uri, e)
                self.run_id, logged = None, {}
        if self.run_id is None:
            exp = self.client.get_experiment_by_name(run.project)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(run.project)
            self.run_id = self.client.create_run(exp_id, run_name=run.experiment).info.run_id
        _store_id(run, self.ID_FILE, self.run_id)
        params = flat_params(run.config)
        changed = sorted(k for k, v in params.items() if k in logged and logged[k] != v[:self._MAX_VALUE])
        if changed:  # mlflow never changes a logged param
            log.warning("mlflow: the resumed run %s keeps its logged values of %s", self.run_id, ", ".join(changed))
        new = [Param(k, v) for k, v in params.items() if k not in logged]
        for i in range(0, len(new), 100):  # mlflow's params per batch
            self.client.log_batch(self.run_id, params=new[i:i + 100])

    def log(self, metrics: Dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(mlflow_key(k), v, now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):  # mlflow's metrics per batch
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


@dataclass(frozen=True)
class Backend:
    """A tracker: its class, the module its package provides, the pip package (extra) to install."""

    open: Callable[[RunInfo], Logger]
    module: str
    pip: str
    extra: Optional[str] = None  # dapo-kernels[extra]
    required: bool = True  # False: a missing package is a warning, the run goes on without it


# One entry per name of config.choices.Logger but "console" (which opens nothing).
BACKENDS: Dict[str, Backend] = {
    "tensorboard": Backend(TensorBoardLogger, "torch.utils.tensorboard", "tensorboard", required=False),
    "wandb": Backend(WandbLogger, "wandb", "wandb", extra="wandb"),
    "mlflow": Backend(MlflowLogger, "mlflow", "mlflow-skinny", extra="mlflow"),
}


def _missing(name: str) -> Optional[str]:
    """Why ``name``'s package cannot be imported (None: it can)."""
    b = BACKENDS[name]
    try:
        importlib.import_module(b.module)
    except ImportError as e:
        how = f"pip install {b.pip}" + (f" (or pip install 'dapo-kernels[{b.extra}]')" if b.extra else "")
        return f"trainer.logger: {name!r} needs the {b.pip} package, which cannot be imported ({e}); {how}"
    return None


def _unavailable(names: Sequence[str]):
    """``(problems, skipped)``: why each requested required tracker cannot be imported; the optional ones
    that cannot, ``{name: why}``."""
    problems, skipped = [], {}
    for name in dict.fromkeys(n for n in names if n in BACKENDS):
        why = _missing(name)
        if why is not None and BACKENDS[name].required:
            problems.append(why)
        elif why is not None:
            skipped[name] = why
    return problems, skipped


def check_installed(names: Sequence[str], *, warn: bool = True) -> List[str]:
    """Start-up check of ``trainer.logger``: an ImportError naming the key and the package of each
    requested tracker that cannot be imported; an optional one is a warning (when ``warn``). Returns
    the optional ones skipped."""
    problems, skipped = _unavailable(names)
    if problems:
        raise ImportError("\n".join(problems))
    for why in skipped.values() if warn else ():
        log.warning("%s; the run goes on without it", why)
    return list(skipped)


def open_loggers(names: Sequence[str], run: RunInfo) -> List[Logger]:
    """The trackers ``names`` asks for (what :func:`check_installed` refuses is refused here too, what it
    skips is skipped); if one fails to open, those already open are closed as failed."""
    problems, skipped = _unavailable(names)
    if problems:
        raise ImportError("\n".join(problems))
    opened: List[Logger] = []
    try:
        for name in dict.fromkeys(names):
            if name in BACKENDS and name not in skipped:
                opened.append(BACKENDS[name].open(run))
    except BaseException:
        for tracker in opened:
            tracker.close(failed=True)
        raise
    return opened
