"""The DAPO training loop on dapo_kernels' ops, built from its components.

One step (``DAPOTrainer.train_step``):

1. :class:`~dapo_trainer.generation.GenerationStage`: generate ``rollout.n`` responses for
   ``data.gen_batch_size`` prompts, reward them (plus the overlong penalty), filter groups
   (``dk.group_filter``: keep groups whose metric varies; GRPO advantages of the final reward) and
   accumulate (``dk.DynamicBatchAccumulator``) until ``data.train_batch_size`` groups are kept
   (``DynamicSamplingExhausted`` after ``max_num_gen_batches``);
2. :class:`~dapo_trainer.actor.Actor`: old log-probs (skipped on-policy: one mini-batch, one epoch),
   the rollout correction (``algorithm.rollout_correction`` with ``rollout.calculate_log_probs``: IS
   weights and rejection mask for the loss; ``bypass_mode``: the rollout's log-probs are the old ones,
   no old-log-prob pass) and reference log-probs, then the policy update per mini-batch; an update
   whose loss or gradient norm is not finite is skipped (the run stops after
   ``trainer.max_nonfinite_steps`` such steps in a row);
3. push the weights to the rollout engine; log (:func:`~dapo_trainer.batch_metrics.batch_metrics`).

Under ``async_training.enable`` step 1 takes the next train batch(es) from rollout worker processes
that generate while the trainer trains (:class:`~dapo_trainer.async_rollout.AsyncRollout`), and
step 3 also pushes the weights to them every ``async_training.trigger_parameter_sync_step`` steps;
the trainer's own engine then only validates.

Parallelism (:class:`~dapo_trainer.parallel.ParallelDims`): every data-parallel replica samples its
share of the generation batch and the shares are all-gathered, so every rank holds the same batch
(the same one for any number of processes). The update is split over data-parallel ranks (torch's
DDP, or FSDP2) and, inside a DP rank, tensor parallel over ``actor.tensor_model_parallel_size``
ranks or sequence parallel (Ulysses) over ``actor.ulysses_sequence_parallel_size`` ranks: those take
the same micro-batches and each computes a contiguous shard of their tokens; gradients are then
reduced over DP x SP ranks. Under pipeline parallelism (``actor.pipeline_model_parallel_size``)
each rank holds some layers (:class:`~dapo_trainer.actor.PipelinedActor`) and a sampling replica.
"""
from __future__ import annotations

import logging
import os
import time
import weakref
from typing import Dict, Optional

import torch
import torch.distributed as dist

from . import checkpoint as ckpt
from . import data as data_mod
from . import envs, rollout_dump
from .actor import Actor, PipelinedActor
from .adaptive_sampling import gen_time_share
from .batch_metrics import batch_metrics
from .config import Config, dump_config
from .generation import GenerationStage
from .hf_io import load_hf_model, read_hf_config
from .loggers import RunInfo, check_installed
from .metrics import MetricsLogger
from .offload import ActivationOffload
from .parallel import ParallelDims, full_state_dict, parallelize_model, pipeline_state_dict, stage_keep
from .rollout import make_rollout
from .run_dir import RunDirectoryInUse, check_checkpoint_dir
from .run_dir import claim as claim_run_dir

__all__ = ["DAPOTrainer", "NonFiniteTrainingError", "resolve_device"]

_BROKEN = object()  # the rollout workers' state after a failure: nothing to restart from
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
logger = logging.getLogger(__name__)


class NonFiniteTrainingError(RuntimeError):
    """``trainer.max_nonfinite_steps`` steps in a row had their updates skipped for a
    non-finite loss or gradient norm."""


def resolve_device(name: str) -> torch.device:
    """``trainer.device`` as a torch device; a ValueError naming the key when it is not usable here."""
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("trainer.device='cuda': CUDA is not available (torch.cuda.is_available() is False: no "
                         f"GPU visible, or torch {torch.__version__} is a CPU build); use trainer.device=cpu or auto")
    if name == "npu":
        from npu_ops import torch_npu

        try:
            torch_npu()  # registers the "npu" device with torch
        except RuntimeError as e:
            raise ValueError(f"trainer.device='npu' cannot be used here: {e}") from None
        if not torch.npu.is_available():
            raise ValueError("trainer.device='npu': torch_npu sees no Ascend NPU (torch.npu.is_available() is "
                             "False); use trainer.device=cpu or auto")
    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if hasattr(torch, "npu") and torch.npu.is_available():
        return torch.device("npu")
    return torch.device("cpu")


def build_model(cfg: Config, dims: ParallelDims, device: torch.device, path: str, trainable: bool = True):
    """The HF model at ``path`` with the run's checkpointing / offload, parallelised by ``dims``."""
    m = cfg.actor_rollout_ref.model
    model = load_hf_model(path, _DTYPES[m.dtype], device, keep=stage_keep(dims.pp_rank, dims.pp, dims.vpp))
    model.activation_checkpointing = m.enable_gradient_checkpointing and trainable
    if model.activation_checkpointing and m.enable_activation_offload:
        model.activation_offload = ActivationOffload()
    parallelize_model(model, dims, fsdp=trainable and cfg.actor_rollout_ref.actor.strategy == "fsdp2")
    model.requires_grad_(trainable)
    return model


def find_resume_dir(cfg: Config, ckpt_root: str) -> Optional[str]:
    """The checkpoint ``trainer.resume_mode`` resumes from (None: start fresh)."""
    t = cfg.trainer
    if t.resume_mode == "disable":
        return None
    if t.resume_mode == "resume_path":
        held = ckpt.checkpoints_in(t.resume_from_path)
        if held:  # verl's resume_from_path is one global_step_N directory too, never the folder of them
            raise ValueError(f"trainer.resume_from_path: {t.resume_from_path!r} is a checkpoints directory holding "
                             f"{', '.join(held)}, not one checkpoint: name one of them (e.g. "
                             f"{os.path.join(t.resume_from_path, held[-1])}), or use trainer.resume_mode=auto, "
                             "which resumes the newest complete one under trainer.default_local_dir")
        why = ckpt.incomplete_reason(t.resume_from_path)
        if why is not None:
            raise ValueError(f"trainer.resume_from_path: {t.resume_from_path!r} is not a complete checkpoint: {why}")
        return t.resume_from_path
    return ckpt.latest_checkpoint(ckpt_root)


# The ModelConfig fields that fix the parameters' shapes and the model's function.
_ARCHITECTURE = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim", "qkv_bias", "o_bias", "mlp_bias", "tie_word_embeddings", "qk_norm",
                 "norm_unit_offset", "hidden_act", "sandwich_norms", "sliding_window", "layer_types")


def check_resume_model(model_path: str, resume_dir: str) -> None:
    """A checkpoint resumes only the model ``actor_rollout_ref.model.path`` names: another architecture
    would silently train the checkpoint's model instead of the one asked for."""
    want, have = read_hf_config(model_path), read_hf_config(os.path.join(resume_dir, "model"))
    diff = {k: (getattr(want, k), getattr(have, k)) for k in _ARCHITECTURE if getattr(want, k) != getattr(have, k)}
    if diff:
        rows = ", ".join(f"{k} {a} vs {b}" for k, (a, b) in diff.items())
        raise ValueError(f"actor_rollout_ref.model.path {model_path!r} and the checkpoint {resume_dir!r} are different "
                         f"models ({rows}): resume with the model the checkpoint was trained from, or "
                         "trainer.resume_mode=disable")


class DAPOTrainer:
    """DAPO / GRPO trainer. ``DAPOTrainer(cfg).fit()`` trains and returns the final metrics.

    Under ``torch.distributed`` (``torchrun``), the process group must be initialised
    before construction (:func:`dapo_trainer.train.main` does it).
    """

    def __init__(self, cfg: Config):
        if not isinstance(cfg, Config):
            raise TypeError(f"cfg must be a dapo_trainer.config.Config, got {type(cfg).__name__}")
        self.cfg = cfg
        arr, t, d = cfg.actor_rollout_ref, cfg.trainer, cfg.data
        if not arr.model.path:
            raise ValueError("actor_rollout_ref.model.path must name a HF model directory")
        self.device = resolve_device(t.device)
        self.run_dir = t.default_local_dir
        self.ckpt_root = os.path.join(self.run_dir, "checkpoints")
        self.dims = ParallelDims.build(arr.actor, arr.rollout.n, self.device)
        # Every rank refuses a missing tracker package (none is left alone in a collective); rank 0 warns.
        check_installed(t.logger, warn=self.dims.rank == 0)

        self.tokenizer = data_mod.load_tokenizer(arr.model.path)
        if not d.train_files:
            raise ValueError("data.train_files must name at least one .jsonl / .parquet file")
        train_rows, train_where = data_mod.load_rows_located(d.train_files, d.prompt_key)
        self.val_rows, val_where = data_mod.load_rows_located(d.val_files, d.prompt_key) if d.val_files else ([], [])
        self.val_rows, val_where = self.val_rows[:d.val_rows_limit], val_where[:d.val_rows_limit]
        # Multi-turn: an environment plays the user / tool side (dapo_trainer.envs, rollout/multiturn.py).
        ec = cfg.environment
        env = envs.load_environment(ec.path, ec.name) if ec.path else None
        # Single-turn prompts are tokenised and length-checked once, here (multi-turn ones come from the environment).
        train_prompts, self.val_prompts = ({}, None) if env is not None else (
            data_mod.encode_rows(self.tokenizer, train_rows, train_where, d),
            data_mod.encode_rows(self.tokenizer, self.val_rows, val_where, d))

        check_checkpoint_dir(self.ckpt_root, "trainer.default_local_dir")
        if t.rollout_data_dir:
            rollout_dump.check_rollout_dir(t.rollout_data_dir)
        self.release_run_dir = self._claim_run_dir(fresh=t.resume_mode == "disable")  # before recovery touches it
        self.resume_dir = find_resume_dir(cfg, self.ckpt_root)
        if self.resume_dir:
            err = None
            try:  # before anything of it is read; the ranks split the hashing
                ckpt.verify_checkpoint(self.resume_dir, share=(self.dims.rank, self.dims.world))
            except ValueError as e:
                err = e
            self._raise_on_every_rank(err)
            check_resume_model(arr.model.path, self.resume_dir)
            ckpt.check_resume_layout(self.resume_dir, self.dims.world, ckpt.layout_of(self.dims))
            if self.dims.rank == 0:
                print(f"resuming from {self.resume_dir}", flush=True)
        model_dir = os.path.join(self.resume_dir, "model") if self.resume_dir else arr.model.path
        self.model = build_model(cfg, self.dims, self.device, model_dir)
        ref_model = (build_model(cfg, self.dims, self.device, arr.model.path, trainable=False)
                     if arr.actor.use_kl_loss else None)
        # The embedded engine samples from the training model as it is sharded (TP shards; FSDP2
        # one layer gathered at a time, the DP ranks in lockstep); vLLM receives its gathered
        # weights. Three cases keep an unsharded replica, refreshed after every update: SP (the
        # model's forward keeps one token shard), PP (a rank holds some layers), EP (each forward exchanges
        # tokens with the other DP ranks, which sample other prompts for other numbers of steps) and
        # multi-turn environments under FSDP2 with several DP ranks (different numbers of engine calls: no lockstep).
        dims = self.dims
        replica = (dims.sp > 1 or dims.pp > 1 or dims.ep > 1
                   or (env is not None and arr.actor.strategy == "fsdp2" and dims.dp > 1))
        self.rollout_model = (load_hf_model(model_dir, _DTYPES[arr.model.dtype], self.device) if replica
                              else self.model)
        self.engine = make_rollout(arr.rollout.engine_config(), self.rollout_model)
        self.actor = (PipelinedActor if dims.pp > 1 else Actor)(cfg, dims, self.model, ref_model, device=self.device)
        # Router replay R3: the sampler records each token's experts (sparse layers x experts per token).
        routes = 0
        if arr.rollout.enable_rollout_routing_replay:
            self.engine.record_routing = True
            routes = len(self.rollout_model.sparse_blocks()) * self.rollout_model.config.num_experts_per_tok
        self.generation = GenerationStage(cfg, dims, self.tokenizer, self.engine, train_rows, env,
                                          prompt_cache=train_prompts, routes=routes)

        self.global_step = 0
        self.nonfinite_streak = 0  # consecutive steps with a skipped update
        # async_training: the rollout workers start at the first step (AsyncRollout), from the saved state.
        self.model_dir, self.async_rollout, self._async_saved = model_dir, None, None
        if cfg.async_training.enable:  # checked here, before any rollout worker starts (the first step)
            if dims.world > 1 or self.device.type != "cpu":
                raise ValueError(f"async_training.enable=true runs one trainer process on the CPU; this run has "
                                 f"{dims.world} processes on {self.device.type} (trainer.device={t.device!r})")
            if cfg.rollout.n_gpus_per_node > len(train_rows):  # worker w draws rows w, w + W, ...
                raise ValueError(f"rollout.n_gpus_per_node={cfg.rollout.n_gpus_per_node} rollout workers, but "
                                 f"data.train_files has {len(train_rows)} rows: every worker needs one at least")
        if self.resume_dir:
            state = ckpt.load_checkpoint(self.resume_dir, optimizer=self.actor.optimizer,
                                         scheduler=self.actor.scheduler)
            self.global_step = state["step"]
            self.nonfinite_streak = state.get("nonfinite_streak", 0)
            self.generation.load_state_dict(state)
            if ("async" in state) != cfg.async_training.enable:  # queued batches / worker cursors would be lost
                raise ValueError(f"async_training.enable={cfg.async_training.enable}, but the checkpoint "
                                 f"{self.resume_dir!r} was saved with async_training.enable={'async' in state}: "
                                 "resume with the mode that saved it")
            self._async_saved = state.get("async")
            if cfg.async_training.enable:
                from .async_rollout import check_resumable

                check_resumable(cfg, self._async_saved)

    @staticmethod
    def _raise_on_every_rank(err: Optional[Exception]) -> None:
        """Raise the lowest rank's ``err`` on every rank (None everywhere: return), so that no rank
        is left waiting alone in a later collective."""
        if dist.is_initialized():
            errs = [None] * dist.get_world_size()
            dist.all_gather_object(errs, err)
            err = next((e for e in errs if e is not None), None)
        if err is not None:
            raise err

    def _claim_run_dir(self, *, fresh: bool):
        """Rank 0 claims ``trainer.default_local_dir`` (:func:`dapo_trainer.run_dir.claim`) until this
        trainer is collected; every rank raises its refusal. Returns the release function."""
        release, err = (lambda: None), None
        if self.dims.rank == 0:
            try:
                release = claim_run_dir(self.run_dir, fresh=fresh)
            except (ValueError, RunDirectoryInUse, OSError) as e:
                err = e
        self._raise_on_every_rank(err)
        weakref.finalize(self, release)
        return release

    def sync_weights(self) -> None:
        if self.rollout_model is not self.model:  # the replica (SP; PP; EP; multi-turn under FSDP2 with DP > 1)
            self.rollout_model.load_state_dict(self.full_state())
        self.engine.update_weights(self.rollout_model)

    def validate(self) -> Dict[str, float]:
        """Greedy (``rollout.val_kwargs``) decoding of the validation rows, split over the
        data-parallel replicas (the ranks of a TP group sample the same rows together)."""
        if not self.val_rows:
            return {}
        d, vk, gen = self.cfg.data, self.cfg.actor_rollout_ref.rollout.val_kwargs, self.generation
        dp = self.dims.rollout_ranks  # the DP replicas, or every rank where each holds a replica (PP, SP)
        mine = list(range(self.dims.rollout_rank, len(self.val_rows), dp))
        most = -(-len(self.val_rows) // dp)  # every replica runs as many batches (FSDP2 lockstep)
        sums = torch.zeros(4, dtype=torch.float64)
        for start in range(0, most, d.val_batch_size):
            idx = mine[start:start + d.val_batch_size]
            if not idx:
                gen.join_lockstep(d.max_response_length)
                continue
            rows = [self.val_rows[i] for i in idx]
            ep = gen.rollout(rows=rows, keys=idx, cache=self.val_prompts, n=vk.n, temperature=vk.temperature,
                             top_p=vk.top_p, seed=gen.seed(self.global_step, -1))
            score, acc, _ = gen.score(ep, rows)
            sums += torch.tensor([sum(score), sum(acc), float(ep.out.lengths.sum()), len(score)], dtype=torch.float64)
        if dp > 1:
            sums = sums.to(self.dims.comm_device)
            dist.all_reduce(sums, group=self.dims.rollout_group)
        score, acc, length, n = sums.tolist()
        n = max(n, 1.0)
        return {"val/score": score / n, "val/acc": acc / n, "val/response_length": length / n}

    def rollout_workers(self):
        """The :class:`~dapo_trainer.async_rollout.AsyncRollout` (started on first use; None when off)."""
        if self.cfg.async_training.enable and self.async_rollout is None:
            from .async_rollout import AsyncRollout

            if self._async_saved is _BROKEN:
                raise RuntimeError("the rollout workers failed and were stopped; resume from the last checkpoint")
            self.async_rollout = AsyncRollout(self.cfg, self.model_dir, self.full_state(), self._async_saved)
            weakref.finalize(self, self.async_rollout.close)
        return self.async_rollout

    def close(self) -> None:
        """Stop the rollout workers (async_training); a later step starts them again from where they were."""
        if self.async_rollout is not None:
            workers, self.async_rollout = self.async_rollout, None
            try:
                self._async_saved = workers.state_dict()
            except Exception as e:  # a worker's error report: the stream cannot go on from here
                self._async_saved = _BROKEN
                logger.warning("rollout workers stopped after an error: %s", e)
            finally:
                workers.close()

    def train_step(self) -> Dict[str, float]:
        """One DAPO step; returns its metrics (without validation)."""
        step = self.global_step + 1
        t0 = time.perf_counter()
        workers = self.rollout_workers()
        batch, metrics = workers.next_batch() if workers is not None else self.generation.collect(step)
        metrics.update(self.actor.update(batch))
        self.nonfinite_streak = self.nonfinite_streak + 1 if metrics["actor/skipped_updates"] else 0
        if metrics["actor/skipped_updates"] and self.dims.rank == 0:
            logger.warning("step %d: update skipped: %s", step, metrics["actor/skip_reason"])
        t1 = time.perf_counter()
        self.sync_weights()
        if workers is not None and step % self.cfg.async_training.trigger_parameter_sync_step == 0:
            workers.sync(self.full_state())
        metrics["timing_s/update_weights"] = time.perf_counter() - t1
        metrics.update(batch_metrics(batch, self.cfg.data.max_response_length))
        metrics["timing_s/step"] = time.perf_counter() - t0
        metrics["perf/tokens_per_s"] = metrics["train/gen_tokens"] / max(metrics["timing_s/step"], 1e-9)
        # Synchronous: generation vs the update and weight sync; async: the step's wait for its batches.
        metrics["perf/gen_time_share"] = (gen_time_share(metrics) if workers is None else
                                          metrics["timing_s/wait_batch"] / max(metrics["timing_s/step"], 1e-9))
        self.global_step = step
        return metrics

    def full_state(self) -> dict:
        """The whole model's unsharded state_dict on every rank (collective; PP: every stage's)."""
        return pipeline_state_dict(self.model, self.dims) if self.dims.pp > 1 else full_state_dict(self.model)

    def save(self) -> str:
        state = {"step": self.global_step, **self.generation.state_dict(), "nonfinite_streak": self.nonfinite_streak}
        if self.cfg.async_training.enable:  # the batches generated, not yet trained, and the workers' state
            state["async"] = self.async_rollout.state_dict() if self.async_rollout is not None else self._async_saved
        full = self.full_state()  # (the plain state_dict when nothing is sharded)
        return ckpt.save_checkpoint(self.ckpt_root, self.global_step, model=self.model, full_state=full,
                                    optimizer=self.actor.optimizer, scheduler=self.actor.scheduler,
                                    trainer_state=state, model_src_dir=self.cfg.actor_rollout_ref.model.path,
                                    layout=ckpt.layout_of(self.dims))

    def fit(self) -> Dict[str, float]:
        """Train to ``trainer.total_training_steps``; returns the last step's metrics."""
        t = self.cfg.trainer
        log = MetricsLogger(self.run_dir, t.total_training_steps, start_step=self.global_step,
                            enabled=self.dims.rank == 0, progress_bar=t.progress_bar, loggers=t.logger,
                            run=RunInfo(self.run_dir, t.project_name, t.experiment_name, self.cfg.to_dict()))
        metrics: Dict[str, float] = {}
        failed = True  # until the loop ends: the trackers' runs are then marked failed
        try:
            if self.dims.rank == 0:  # what the run trained with, beside its metrics (dapo-report reads it)
                dump_config(self.cfg, os.path.join(self.run_dir, "config.yaml"))
            if self.global_step < t.total_training_steps:
                self.rollout_workers()  # async: the workers start (and generate) while the first validation runs
            if self.global_step == 0 and t.val_before_train and self.val_rows:
                metrics = self.validate()
                log.log(0, metrics)
            while self.global_step < t.total_training_steps:
                metrics = self.train_step()
                step, last = self.global_step, self.global_step == t.total_training_steps
                if (t.test_freq > 0 and step % t.test_freq == 0) or last:
                    t0 = time.perf_counter()
                    metrics.update(self.validate())
                    metrics["timing_s/validate"] = time.perf_counter() - t0
                log.log(step, metrics)
                log.progress(step, metrics)
                if self.nonfinite_streak >= t.max_nonfinite_steps:
                    raise NonFiniteTrainingError(
                        f"trainer.max_nonfinite_steps={t.max_nonfinite_steps}: {self.nonfinite_streak} steps in a row "
                        f"(the last: step {step}, {metrics['actor/skip_reason']}) had a non-finite loss or gradient "
                        "norm, and their updates were skipped; stopping. The weights are those of the last applied "
                        "update; look at the learning rate, the loss coefficients and the data before resuming")
                if (t.save_freq > 0 and step % t.save_freq == 0) or last:
                    self.save()
            failed = False
        finally:
            self.close()
            log.close(failed=failed)
        return metrics
