"""The DAPO training loop on dapo_kernels' ops.

One step (``DAPOTrainer.train_step``):

1. generate ``rollout.n`` responses for ``data.gen_batch_size`` prompts (rollout engine);
2. reward the decoded responses, add the overlong penalty, compute the filter metric;
3. ``dk.group_filter`` (keep groups whose metric varies; GRPO advantages of the final
   reward) and ``dk.DynamicBatchAccumulator`` until ``data.train_batch_size`` groups are
   kept (``DynamicSamplingExhausted`` after ``max_num_gen_batches``);
4. old log-probs (skipped on-policy: one mini-batch, one epoch) and reference log-probs, projected
   onto the vocabulary only where the response mask is set (``masked_log_probs``);
5. per mini-batch: sequences balanced over data-parallel ranks (``dk.balanced_partitions``),
   token-capped micro-batches (``dk.micro_batches``, balanced by attention workload; the cap is
   per rank, so an SP group's micro-batch holds SP times as many tokens) packed through the model,
   ``dk.fused_linear_policy_loss`` normalised by the mini-batch's global token count,
   gradients averaged over data-parallel ranks by torch's DDP (once per mini-batch: the
   micro-batches before the last accumulate under ``no_sync``) or FSDP2, clipping, AdamW
   with warmup; an update whose loss or gradient norm is not finite is skipped (the run
   stops after ``trainer.max_nonfinite_steps`` such steps in a row);
6. push the weights to the rollout engine; log.

Parallelism: each data-parallel replica (a TP group) samples and rewards its share of the
generation batch, whole prompt groups, with the counter-based streams the whole batch
would draw, and the shares are all-gathered: every rank holds the same batch (the same one
for any number of processes) and dynamic sampling decides identically everywhere. The
update is split over data-parallel ranks (torch's DDP, or FSDP2) and, inside a DP rank,
tensor parallel over ``actor.tensor_model_parallel_size`` ranks or sequence parallel (Ulysses)
over ``actor.ulysses_sequence_parallel_size`` ranks: those take the same micro-batches and each
computes a contiguous shard of their tokens; gradients are then reduced over DP x SP ranks.
"""
from __future__ import annotations

import logging
import math
import os
import time
from collections import defaultdict
from contextlib import nullcontext
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

import dapo_kernels as dk
from dapo_kernels.validation import to_device_checked

from . import checkpoint as ckpt
from . import data as data_mod
from . import dialogue, envs, rewards
from .config import Config
from .hf_io import load_hf_model
from .metrics import MetricsLogger
from .offload import ActivationOffload
from .parallel import (apply_ddp, apply_fsdp, apply_sequence_parallel, balanced_dp_split, collective_device,
                       full_state_dict, make_mesh, parallelize, shard_sequence, sp_micro_batches, tp_shard_dims)
from .rollout import make_rollout
from .rollout.multiturn import multi_turn_rollout

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Metrics of the update that are per-token fractions, averaged over response tokens.
_TOKEN_AVG = ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "entropy")
# The update's metric sums kept on the device, in this order (token-weighted ones times tokens).
_DEVICE_SUMS = ("pg_loss", "kl_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "entropy", "tokens")
# Per-response columns a rollout share carries after its padded response ids and log-probs.
_SHARE_COLUMNS = ("prompt_len", "response_len", "stopped", "score", "acc", "reward", "filter_metric", "failed",
                  "turns")
logger = logging.getLogger(__name__)


class NonFiniteTrainingError(RuntimeError):
    """``trainer.max_nonfinite_steps`` steps in a row had their updates skipped for a
    non-finite loss or gradient norm."""


def resolve_device(name: str) -> torch.device:
    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if hasattr(torch, "npu") and torch.npu.is_available():
        return torch.device("npu")
    return torch.device("cpu")


class DAPOTrainer:
    """DAPO / GRPO trainer. ``DAPOTrainer(cfg).fit()`` trains and returns the final metrics.

    Under ``torch.distributed`` (``torchrun``), the process group must be initialised
    before construction (:func:`dapo_trainer.train.main` does it).
    """

    def __init__(self, cfg: Config):
        if not isinstance(cfg, Config):
            raise TypeError(f"cfg must be a dapo_trainer.config.Config, got {type(cfg).__name__}")
        self.cfg = cfg
        arr, t = cfg.actor_rollout_ref, cfg.trainer
        self.actor_cfg, self.rollout_cfg = arr.actor, arr.rollout
        if not arr.model.path:
            raise ValueError("actor_rollout_ref.model.path must name a HF model directory")
        self.device = resolve_device(t.device)
        self.run_dir = t.default_local_dir
        self.ckpt_root = os.path.join(self.run_dir, "checkpoints")
        self._setup_parallel()

        self.tokenizer = data_mod.load_tokenizer(arr.model.path)
        # Prompts rendered with the model's chat template hold their special tokens already.
        self._chat = self.tokenizer.uses_chat(cfg.data.apply_chat_template)
        d = cfg.data
        if not d.train_files:
            raise ValueError("data.train_files must name at least one .jsonl / .parquet file")
        self.train_rows = data_mod.load_rows(d.train_files, d.prompt_key)
        self.val_rows = data_mod.load_rows(d.val_files, d.prompt_key) if d.val_files else []
        if d.val_max_samples is not None:
            self.val_rows = self.val_rows[:d.val_max_samples]
        self._prompt_cache: Dict[int, List[int]] = {}
        self.cursor = data_mod.BatchCursor(len(self.train_rows), cfg.gen_batch_size, seed=t.seed, shuffle=d.shuffle)
        self.reward_fn = (rewards.load_reward_fn(cfg.custom_reward_function.path, cfg.custom_reward_function.name)
                          if cfg.custom_reward_function.path else rewards.default_compute_score)
        # Multi-turn: an environment plays the user / tool side (dapo_trainer.envs, rollout/multiturn.py).
        ec = cfg.environment
        self.env = envs.load_environment(ec.path, ec.name) if ec.path else None
        self.scorers = {}
        if self.env is not None and cfg.reward_model.dialogue.scorers:
            from .rewards.scorers import build_scorers

            self.scorers = build_scorers(cfg.reward_model.dialogue)

        self.resume_dir = self._find_resume_dir()
        model_dir = os.path.join(self.resume_dir, "model") if self.resume_dir else arr.model.path
        self.model = self._build_model(model_dir)
        # DDP averages the gradients over data-parallel ranks in the backward (FSDP2 shards
        # them); the training forward runs through the wrapper, log-probs on the model itself.
        self.ddp = None
        if self.grad_ranks > 1 and self.actor_cfg.strategy == "ddp":
            self.ddp = apply_ddp(self.model, self.grad_group)
        self.ref_model = None
        if self.actor_cfg.use_kl_loss:
            self.ref_model = self._build_model(arr.model.path, trainable=False)
        # The embedded engine samples from the training model as it is sharded (TP shards; FSDP2
        # one layer gathered at a time, the DP ranks in lockstep); vLLM receives its gathered
        # weights. Two cases keep an unsharded replica, refreshed after every update: SP (the
        # model's forward keeps one token shard) and multi-turn environments under FSDP2 with
        # several DP ranks (their replicas make different numbers of engine calls: no lockstep).
        replica = self.sp > 1 or (self.env is not None and self.actor_cfg.strategy == "fsdp2" and self.dp > 1)
        self.rollout_model = (load_hf_model(model_dir, _DTYPES[arr.model.dtype], self.device) if replica
                              else self.model)
        self.engine = make_rollout(self.rollout_cfg.engine_config(), self.rollout_model)

        o = self.actor_cfg.optim
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                           weight_decay=o.weight_decay)
        warmup = o.lr_warmup_steps if o.lr_warmup_steps >= 0 else int(o.lr_warmup_steps_ratio * t.total_training_steps)
        # (s + 1) / warmup: the first update already moves the weights (verl's s / warmup
        # spends step 0 at lr 0).
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup > 0 else 1.0)
        fg = cfg.algorithm.filter_groups
        self.accumulator = dk.DynamicBatchAccumulator(
            d.train_batch_size, self.rollout_cfg.n, fg.max_num_gen_batches if fg.enable else 0,
            carry_over=fg.carry_over)
        self.global_step = 0
        self.nonfinite_streak = 0  # consecutive steps with a skipped update
        if self.resume_dir:
            state = ckpt.load_checkpoint(self.resume_dir, optimizer=self.optimizer, scheduler=self.scheduler)
            self.global_step = state["step"]
            self.nonfinite_streak = state.get("nonfinite_streak", 0)
            self.cursor.load_state_dict(state["cursor"])
            ckpt.load_accumulator_state(self.accumulator, state["accumulator"])

    # ------------------------------------------------------------------ setup
    def _setup_parallel(self) -> None:
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.tp = self.actor_cfg.tensor_model_parallel_size
        self.sp = self.actor_cfg.ulysses_sequence_parallel_size
        if self.world % (self.tp * self.sp):
            raise ValueError(f"actor_rollout_ref.actor.tensor_model_parallel_size={self.tp} times "
                             f"ulysses_sequence_parallel_size={self.sp} must divide the number of processes {self.world}")
        self.dp = self.world // (self.tp * self.sp)
        rows = self.actor_cfg.ppo_mini_batch_size * self.rollout_cfg.n
        if rows < self.dp:
            # Each DP rank trains on a share of every mini-batch: a rank without a row would
            # run no backward, and the others would wait in DDP's gradient all-reduce forever.
            raise ValueError(
                f"actor_rollout_ref.actor.ppo_mini_batch_size ({self.actor_cfg.ppo_mini_batch_size}) x "
                f"actor_rollout_ref.rollout.n ({self.rollout_cfg.n}) = {rows} rows per mini-batch, fewer than "
                f"the {self.dp} data-parallel ranks ({self.world} processes / "
                f"actor_rollout_ref.actor.tensor_model_parallel_size {self.tp} / ulysses_sequence_parallel_size "
                f"{self.sp}): every rank needs at least one row; raise the mini-batch size or n, or run fewer "
                "processes")
        self.tp_group = self.dp_group = self.dp_mesh = self.sp_group = None
        # Gradients are reduced over the data-parallel ranks and, under SP, over the SP ranks too:
        # each holds the gradient of its token shard's loss (config validation keeps TP = 1 then,
        # so that is every rank).
        self.grad_ranks = self.dp * self.sp
        self.grad_group = self.grad_mesh = None
        # Where tensors handed to a collective live: the backend's device (NCCL takes CUDA
        # tensors only), whatever the tensor was built from.
        self.comm_device = self.device
        if self.world > 1:
            mesh = make_mesh(self.device, tp=self.tp, sp=self.sp)
            self.tp_group, self.dp_mesh = mesh["tp"].get_group(), mesh["dp"]
            self.dp_group = self.dp_mesh.get_group()
            self.grad_group, self.grad_mesh = self.dp_group, self.dp_mesh
            if self.sp > 1:
                self.sp_group = mesh["sp"].get_group()
                self.grad_group = self.grad_mesh = dist.group.WORLD
            self.comm_device = collective_device(self.dp_group)

    def _build_model(self, path: str, trainable: bool = True):
        arr = self.cfg.actor_rollout_ref
        model = load_hf_model(path, _DTYPES[arr.model.dtype], self.device)
        model.activation_checkpointing = arr.model.enable_gradient_checkpointing and trainable
        if model.activation_checkpointing and arr.model.enable_activation_offload:
            model.activation_offload = ActivationOffload()
        if self.tp > 1:
            parallelize(model, self.tp_group)
        if self.sp > 1:
            apply_sequence_parallel(model, self.sp_group)
        if trainable and self.actor_cfg.strategy == "fsdp2" and self.grad_ranks > 1:
            apply_fsdp(model, self.grad_mesh)
        model.requires_grad_(trainable)
        return model

    def _find_resume_dir(self) -> Optional[str]:
        t = self.cfg.trainer
        if t.resume_mode == "disable":
            return None
        if t.resume_mode == "resume_path":
            why = ckpt.incomplete_reason(t.resume_from_path)
            if why is not None:
                raise ValueError(f"trainer.resume_from_path: {t.resume_from_path!r} is not a complete checkpoint: {why}")
            return t.resume_from_path
        return ckpt.latest_checkpoint(self.ckpt_root)

    # ------------------------------------------------------------------ rollout + reward
    def _prompt_ids(self, rows_idx: List[int], rows: List[dict], cache: Optional[dict]) -> List[List[int]]:
        """Templated, tokenised, length-checked prompts of ``rows[i] for i in rows_idx`` (memoised in ``cache``)."""
        d = self.cfg.data
        cache = {} if cache is None else cache
        for i in rows_idx:
            if i not in cache:
                text = self.tokenizer.prompt_text(rows[i]["prompt"], d.prompt_template, d.apply_chat_template)
                cache[i] = data_mod.encode_prompt(self.tokenizer, text, d.max_prompt_length, d.truncation,
                                                  add_special_tokens=not self._chat)
        return [cache[i] for i in rows_idx]

    def _rollout(self, idx: List[int], rows: List[dict], all_rows: List[dict], cache: Optional[dict], n: int,
                 temperature: float, top_p: float, seed: int, prompt_offset: int = 0):
        """``(out, prompt ids per row)``: one engine call, or a multi-turn rollout with the environment.
        ``prompt_offset``: index of the first row in the whole generation batch (single-turn streams)."""
        d = self.cfg.data
        if self.env is None:
            prompts = self._prompt_ids(idx, all_rows, cache)
            return self.engine.generate(prompts, n, d.max_response_length, temperature=temperature, top_p=top_p,
                                        seed=seed, stop_token_ids=self.tokenizer.eos_token_ids,
                                        prompt_offset=prompt_offset), prompts
        ec = self.cfg.environment
        out = multi_turn_rollout(self.engine, self.tokenizer, self.env, rows, n, max_prompt_length=d.max_prompt_length,
                                 max_response_length=d.max_response_length, max_turns=ec.max_turns,
                                 max_turn_tokens=ec.max_turn_tokens, temperature=temperature, top_p=top_p, seed=seed,
                                 use_chat_template=d.apply_chat_template, truncation=d.truncation,
                                 on_error=ec.on_error)
        return out, out.prompt_ids

    def _score(self, out, rows: List[dict]):
        """Rewards of every response: (score, acc, components) lists, response texts."""
        if self.env is not None:
            return dialogue.score_dialogues(
                out, rows, reward_fn=self.reward_fn if self.cfg.custom_reward_function.path else None,
                weights=self.cfg.reward_model.dialogue.weights, scorers=self.scorers,
                max_response_length=self.cfg.data.max_response_length)
        stops = set(self.tokenizer.eos_token_ids)
        scores, accs, comps = [], [], []
        max_len = self.cfg.data.max_response_length
        for k in range(out.num_responses):
            ids = out.response(k)
            truncated = not ids or ids[-1] not in stops
            body = ids if truncated else ids[:-1]
            row = rows[out.group_index[k].item()]
            res = self.reward_fn(row["data_source"], self.tokenizer.decode(body), row["ground_truth"],
                                 {"prompt": row["prompt"], "response_length": len(ids),
                                  "max_response_length": max_len, "truncated": truncated})
            if isinstance(res, dict):
                if "score" not in res:
                    raise ValueError(f"reward function returned a dict without 'score': {sorted(res)}")
                score = float(res["score"])
                acc = float(res["acc"]) if "acc" in res else float(score > 0)
            else:
                score, res = float(res), {}
                acc = float(score > 0)
            scores.append(score)
            accs.append(acc)
            comps.append(res)
        return scores, accs, comps

    def _filter_metric(self, score, acc, final, comps) -> torch.Tensor:
        m = self.cfg.algorithm.filter_groups.metric
        if m == "acc":
            return acc
        if m in ("score", "seq_reward"):
            return score
        if m == "seq_final_reward":
            return final
        vals = []
        for c in comps:
            missing = [name for name in m if name not in c]
            if missing:
                raise ValueError(f"algorithm.filter_groups.metric weights {missing}, which the reward function "
                                 f"did not return (it returned {sorted(c)})")
            vals.append(sum(float(w) * float(c[name]) for name, w in m.items()))
        return torch.tensor(vals, dtype=torch.float64)

    def _seed(self, step: int, k: int) -> int:
        return (self.cfg.trainer.seed * 1_000_003 + step * 10_007 + k) % (2 ** 62)

    def _sample_share(self, idx: List[int], rows: List[dict], offset: int, seed: int):
        """Sample, reward and measure this data-parallel replica's share of a generation batch
        (rows ``idx`` of the data, from index ``offset`` of the batch). Returns ``(table,
        local_tokens, timing, turn_stats, reward components)``: one float64 row per response, prompt ids, response
        ids, log-probs and sampled-token mask padded to ``data.max_prompt_length`` /
        ``max_response_length``, then the columns of :data:`_SHARE_COLUMNS`."""
        d, r = self.cfg.data, self.rollout_cfg
        R, P = d.max_response_length, d.max_prompt_length
        table = torch.zeros(len(rows) * r.n, P + 3 * R + len(_SHARE_COLUMNS), dtype=torch.float64)
        if not rows:  # more replicas than prompts: this one only receives
            self._join_lockstep(R)
            return table, 0, {"gen": 0.0, "reward": 0.0}, {}, []
        t0 = time.perf_counter()
        out, prompts = self._rollout(idx, rows, self.train_rows, self._prompt_cache, r.n, r.temperature, r.top_p,
                                     seed, offset)
        t1 = time.perf_counter()
        score, acc, comps = self._score(out, rows)
        score = torch.tensor(score, dtype=torch.float64)
        acc = torch.tensor(acc, dtype=torch.float64)
        lengths = out.lengths
        final = score.clone()
        ob = self.cfg.reward_model.overlong_buffer
        if ob.enable:
            final += dk.overlong_penalty(lengths, R, ob.len, ob.penalty_factor).double()
        metric = dialogue.binarize(self._filter_metric(score, acc, final, comps),
                                   self.cfg.algorithm.filter_groups.reward_threshold)
        # environment.on_error=drop: a group with a failed conversation is never trained on.
        failed = torch.zeros(len(final), dtype=torch.float64)
        failed[list(getattr(out, "errors", {}))] = 1.0
        pad = self.tokenizer.pad_token_id
        table[:, :P + R] = pad
        for k_, g in enumerate(out.group_index.tolist()):
            p = prompts[g]
            table[k_, :len(p)] = torch.tensor(p, dtype=torch.float64)
        valid = torch.arange(R)[None, :] < lengths[:, None]
        table[:, P:P + R][valid] = out.response_ids.double()
        table[:, P + R:P + 2 * R][valid] = out.log_probs.double()
        # Tokens the model sampled (multi-turn: environment tokens are context, never trained on).
        sampled = getattr(out, "response_mask", None)
        table[:, P + 2 * R:P + 3 * R][valid] = 1.0 if sampled is None else sampled.double()
        stop = torch.tensor([f == "stop" for f in out.finish_reasons], dtype=torch.float64)
        prompt_len = torch.tensor([len(prompts[g]) for g in out.group_index.tolist()], dtype=torch.float64)
        # Assistant turns per response (a single-turn response is one), for actor.dynamic_token_len.
        turns = torch.tensor([c.num_turns for c in out.conversations] if self.env is not None else [1] * len(score),
                             dtype=torch.float64)
        table[:, P + 3 * R:] = torch.stack([prompt_len, lengths.double(), stop, score, acc, final, metric, failed,
                                            turns], 1)
        turn_stats = out.turn_stats() if self.env is not None else {}
        return table, int(lengths.sum()), {"gen": t1 - t0, "reward": time.perf_counter() - t1}, turn_stats, comps

    def _gather_shares(self, table: torch.Tensor, rows_per_replica: List[int]) -> torch.Tensor:
        """Every replica's share table, in replica order (one all-gather over the DP group, on its
        device); shares padded to the longest."""
        if self.dp == 1:
            return table
        buf = table.new_zeros(max(rows_per_replica), table.shape[1], device=self.comm_device)
        buf[:table.shape[0]] = table.to(self.comm_device)
        parts = [torch.empty_like(buf) for _ in range(self.dp)]
        dist.all_gather(parts, buf, group=self.dp_group)
        return torch.cat([p[:m] for p, m in zip(parts, rows_per_replica)]).cpu()

    def generation_batch(self, step: int, k: int) -> dict:
        """Generate, reward and filter one generation batch; rows padded to fixed widths.

        Each data-parallel replica (a TP group) samples and rewards a contiguous share of the
        prompts, whole groups, with the random streams the whole batch would draw
        (``prompt_offset``); the shares are all-gathered, so every rank filters the same batch.
        Multi-turn rollouts are split the same way, but their later turns draw streams keyed by
        the replica's own engine calls: with an environment, 1 and 2 replicas sample differently.
        ``turn_stats`` are this replica's.
        """
        d, r = self.cfg.data, self.rollout_cfg
        idx = self.cursor.next_batch()
        B, n, R, P = len(idx), r.n, d.max_response_length, d.max_prompt_length
        bounds = [B * q // self.dp for q in range(self.dp + 1)]
        q = dist.get_rank(self.dp_group) if self.dp > 1 else 0
        lo, hi = bounds[q], bounds[q + 1]
        share, local_tokens, timing, turn_stats, comps = self._sample_share(
            idx[lo:hi], [self.train_rows[i] for i in idx[lo:hi]], lo, self._seed(step, k))
        t0 = time.perf_counter()
        table = self._gather_shares(share, [(bounds[i + 1] - bounds[i]) * n for i in range(self.dp)])
        timing["gen"] += time.perf_counter() - t0
        t2 = time.perf_counter()
        prompt_len, lengths, stop, score, acc, final, metric, failed, turns = table[:, P + 3 * R:].unbind(1)
        prompt_len, lengths = prompt_len.long(), lengths.long()
        algo = self.cfg.algorithm
        adv = dk.group_filter(final, group_size=n, norm_adv_by_std=algo.norm_adv_by_std_in_grpo).check()
        if algo.filter_groups.enable:
            keep = dk.group_filter(metric, group_size=n).check().keep
        else:
            keep = torch.ones(len(final), dtype=torch.bool)
        group_index = torch.arange(B, dtype=torch.int64).repeat_interleave(n)
        keep &= ~(failed.view(B, n).any(1).repeat_interleave(n) > 0)
        tensors = {"prompt_ids": table[:, :P].long(), "prompt_len": prompt_len,
                   "response_ids": table[:, P:P + R].long(), "response_len": lengths,
                   "rollout_log_prob": table[:, P + R:P + 2 * R].float(),
                   "response_mask": table[:, P + 2 * R:P + 3 * R] > 0,
                   "advantages": adv.advantages.float(), "score": score.clone(), "acc": acc.clone(),
                   "reward": final.clone(), "truncated": stop == 0, "num_turns": turns.clone()}
        timing["filter"] = time.perf_counter() - t2
        return {"tensors": tensors, "group_index": group_index, "keep": keep, "metric": metric.clone(),
                "turn_stats": turn_stats, "timing": timing, "tokens": int(prompt_len.sum() + lengths.sum()),
                "local_tokens": local_tokens, "components": {lo * n + i: c for i, c in enumerate(comps)}}

    def collect(self, step: int):
        """Fill a train batch by dynamic sampling. Returns (batch, metrics)."""
        # A step whose train batch the carried-over groups fill generates nothing: its timings are 0, not missing.
        timing, tokens, local_tokens, k = dict.fromkeys(("gen", "reward", "filter"), 0.0), 0, 0, 0
        turn_stats = defaultdict(float)
        dump = [] if self.cfg.trainer.rollout_data_dir and self.rank == 0 else None
        truncated = sampled = 0  # over every generated response, kept or not
        while not self.accumulator.ready:
            gb = self.generation_batch(step, k)
            k += 1
            if dump is not None:
                dump.append(gb)
            for key, v in gb["turn_stats"].items():
                turn_stats[key] += v
            for key, v in gb["timing"].items():
                timing[key] += v
            tokens += gb["tokens"]
            local_tokens += gb["local_tokens"]
            truncated += int(gb["tensors"]["truncated"].sum())
            sampled += len(gb["tensors"]["truncated"])
            t0 = time.perf_counter()
            self.accumulator.add(gb["tensors"], gb["group_index"], gb["keep"], scores=gb["metric"])
            timing["filter"] += time.perf_counter() - t0
        if dump:
            self._dump_rollouts(step, dump)
        fg = self.cfg.algorithm.filter_groups
        batch = self.accumulator.take(fg.prefer, "response_len", seed=self._seed(step, -2))
        am = self.accumulator.last_metrics
        pre = "dynamic_sampling/"
        metrics = {
            "train/num_gen_batches": am[pre + "gen_batches"], "train/seen_groups": am[pre + "groups_seen"],
            "train/kept_groups": am[pre + "groups_kept"], "train/keep_rate": am[pre + "keep_rate"],
            "train/all_correct_groups": am[pre + "groups_all_correct"],
            "train/all_wrong_groups": am[pre + "groups_all_wrong"],
            "train/carried_in_groups": am[pre + "groups_carried_in"],
            "train/carried_over_groups": am[pre + "groups_carried_over"],
            "train/gen_tokens": tokens, "train/gen_responses": sampled,
            # Cut at max_response_length among all sampled responses (the train batch's own rate,
            # response_length/clip_ratio, sees only the kept groups under dynamic sampling).
            "train/gen_truncated_frac": truncated / max(sampled, 1),
            # Response tokens this rank's replica sampled: about 1 / DP of the batch's.
            "train/local_response_tokens": local_tokens,
        }
        metrics.update({f"timing_s/{k_}": v for k_, v in timing.items()})
        # Per-turn statistics of the generated dialogues (means over the generation batches).
        metrics.update({key: v / k if not key.endswith("tokens") and key != "dialog/env_errors" else v
                        for key, v in turn_stats.items()})
        return batch, metrics

    def _dump_rollouts(self, step: int, gbs: List[dict]) -> None:
        """Write ``trainer.rollout_data_dir/{step}.jsonl`` (format: :mod:`dapo_trainer.batch_quality`)."""
        from .tools import batch_quality

        t, n = self.cfg.trainer, self.rollout_cfg.n
        rows = []
        picks = batch_quality.spread_groups([len(gb["keep"]) // n for gb in gbs], n, t.rollout_data_max_rows)
        for k, g in picks:
            gb = gbs[k]
            x = gb["tensors"]
            for j in range(g * n, (g + 1) * n):
                pl, rl = int(x["prompt_len"][j]), int(x["response_len"][j])
                ids = x["response_ids"][j, :rl].tolist()
                comps = {c: v for c, v in gb["components"].get(j, {}).items() if isinstance(v, (int, float, str))}
                rows.append({"step": step, "gen_batch": k, "group": g, "sample": j - g * n,
                             "prompt": self.tokenizer.decode(x["prompt_ids"][j, :pl].tolist()),
                             "response": self.tokenizer.decode(ids), "response_ids": ids, "response_length": rl,
                             "finish_reason": "length" if bool(x["truncated"][j]) else "stop",
                             "score": float(x["score"][j]), "acc": float(x["acc"][j]),
                             "reward": float(x["reward"][j]), "filter_metric": float(gb["metric"][j]),
                             "components": comps, "kept": bool(gb["keep"][j])})
        batch_quality.write_step(t.rollout_data_dir, step, rows)

    # ------------------------------------------------------------------ update
    def _plan(self, batch) -> List[dict]:
        """Per mini-batch: this rank's micro-batches (row indices), the global counts, the token cap
        of its micro-batches (``actor.dynamic_token_len``) and this rank's tokens in them."""
        a, n = self.actor_cfg, self.rollout_cfg.n
        seqlens = (batch["prompt_len"] + batch["response_len"]).tolist()
        turns = batch["num_turns"] if "num_turns" in batch else torch.ones(len(seqlens))
        cap = scaled_token_len(a.ppo_max_token_len_per_gpu, float(turns.double().mean()), a.dynamic_token_len,
                               max(seqlens))
        resp = batch["response_mask"].sum(1).tolist()  # trained-on tokens: multi-turn masks the environment's
        rows_per_mini = a.ppo_mini_batch_size * n
        plan = []
        for start in range(0, len(seqlens), rows_per_mini):
            mini = list(range(start, min(start + rows_per_mini, len(seqlens))))
            mine = mini
            if self.dp > 1:
                part = balanced_dp_split([seqlens[i] for i in mini], self.dp_group,
                                         hidden_size=self.model.config.hidden_size)
                mine = [mini[i] for i in part]
            lens = [seqlens[i] for i in mine]
            if a.use_dynamic_bsz:
                # Per SP group: SP times the per-rank token cap, balanced by attention workload.
                split = dict(hidden_size=self.model.config.hidden_size, sp=self.sp)
                micro = sp_micro_batches(lens, cap, **split)
                if a.strategy == "fsdp2" and self.grad_ranks > 1:
                    # FSDP reduce-scatters in every backward: every rank runs as many.
                    cnt = torch.tensor([len(micro)], device=self.comm_device)
                    dist.all_reduce(cnt, op=dist.ReduceOp.MAX, group=self.grad_group)
                    micro = sp_micro_batches(lens, cap, **split, min_num_micro_batches=int(cnt))
                micro = [[mine[i] for i in mb] for mb in micro]
            else:
                step = a.ppo_micro_batch_size_per_gpu
                micro = [mine[i:i + step] for i in range(0, len(mine), step)]
            plan.append({"micro": micro, "num_tokens": sum(resp[i] for i in mini), "num_seqs": len(mini),
                         "max_token_len": cap if a.use_dynamic_bsz else None, "tokens": sum(lens)})
        return plan

    def _pack(self, batch, rows: List[int]) -> dict:
        """Prompt + response of ``rows`` end to end, labels shifted by one token."""
        ids, cu, mask, adv = [], [0], [], []
        for i in rows:
            pl, rl = int(batch["prompt_len"][i]), int(batch["response_len"][i])
            seq = torch.cat([batch["prompt_ids"][i, :pl], batch["response_ids"][i, :rl]])
            ids.append(seq)
            cu.append(cu[-1] + pl + rl)
            # Position t predicts token t + 1: the response tokens are predicted from
            # positions pl - 1 .. pl + rl - 2.
            m = torch.zeros(pl + rl, dtype=torch.bool)
            m[pl - 1:pl + rl - 1] = batch["response_mask"][i, :rl]
            mask.append(m)
            adv.append(torch.full((pl + rl,), float(batch["advantages"][i])))
        input_ids = torch.cat(ids)
        labels = torch.cat([input_ids[1:], input_ids.new_zeros(1)])
        dev = self.device
        lens = [cu[j + 1] - cu[j] for j in range(len(rows))]
        mask, adv = torch.cat(mask), torch.cat(adv)
        if self.sp > 1:  # the model takes every token and computes this rank's shard; the loss reads that shard
            labels, mask, adv = (shard_sequence(t, self.sp_group) for t in (labels, mask, adv))
        # ids, labels and cu_seqlens are checked here, on the host, so that the model and the loss
        # read nothing of them inside the micro-batch loop. The positions the mask selects (of this
        # rank's shard under SP) are listed here too (a host tensor: no device read), for
        # masked_log_probs.
        return {"input_ids": to_device_checked(input_ids, dev), "labels": to_device_checked(labels, dev),
                "mask": mask.to(dev), "mask_index": mask.nonzero().squeeze(1).to(dev), "advantages": adv.to(dev),
                "cu_seqlens": to_device_checked(torch.tensor(cu, dtype=torch.int32), dev), "max_seqlen": max(lens)}

    @torch.no_grad()
    def _log_probs(self, model, mb: dict) -> torch.Tensor:
        """Old / reference log-probs ``[T]`` of a packed micro-batch (:func:`masked_log_probs`)."""
        return masked_log_probs(model, mb, self.rollout_cfg.temperature)

    def update(self, batch) -> Dict[str, float]:
        """Old / ref log-probs, then the policy update over mini-batches and epochs."""
        a = self.actor_cfg
        timing = {}
        plan = self._plan(batch)
        packed = [[self._pack(batch, rows) for rows in p["micro"]] for p in plan]
        on_policy = a.ppo_epochs == 1 and len(plan) == 1
        t0 = time.perf_counter()
        if not on_policy:
            for mbs in packed:
                for mb in mbs:
                    mb["old_log_prob"] = self._log_probs(self.model, mb)
        timing["timing_s/old_log_prob"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        if self.ref_model is not None:
            for mbs in packed:
                for mb in mbs:
                    mb["ref_log_prob"] = self._log_probs(self.ref_model, mb)
            timing["timing_s/ref"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        # Token-weighted metric sums stay on the device through the micro-batch loop (no host read
        # there); the loss and the gradient norm are read once per update, to decide whether to apply it.
        acc = torch.zeros(len(_DEVICE_SUMS), dtype=torch.float64, device=self.device)
        loss_sum = norm_sum = 0.0
        n_updates, skipped, has_kl = 0, [], False
        seq_mode = a.loss_agg_mode.startswith("seq")
        dp_scale = float(self.grad_ranks)  # DDP and FSDP average gradients; the loss is a global sum
        forward = self.ddp or self.model
        for epoch in range(a.ppo_epochs):
            for i, (p, mbs) in enumerate(zip(plan, packed)):
                self.optimizer.zero_grad(set_to_none=True)
                mini_loss = torch.zeros((), dtype=torch.float64, device=self.device)
                for j, mb in enumerate(mbs):
                    # DDP all-reduces in the last micro-batch's backward only; the others accumulate.
                    sync = self.ddp.no_sync() if self.ddp is not None and j + 1 < len(mbs) else nullcontext()
                    with sync:
                        hidden = forward(mb["input_ids"], mb["cu_seqlens"], mb["max_seqlen"])
                        # Read after the forward: FSDP2 swaps the root's gathered weights in there
                        # (before it, lm_head.weight is this rank's DTensor shard).
                        weight = self.model.lm_head.weight
                        # On-policy (old_log_prob None): the op takes the old log-probs from its own
                        # forward (ratio exactly 1), so no separate log-prob pass runs.
                        loss, m = dk.fused_linear_policy_loss(
                            hidden, weight, mb["labels"], None if on_policy else mb["old_log_prob"], mb["advantages"],
                            mb["mask"], temperature=self.rollout_cfg.temperature, clip_ratio_low=a.clip_ratio_low,
                            clip_ratio_high=a.clip_ratio_high, clip_ratio_c=a.clip_ratio_c,
                            loss_agg_mode=a.loss_agg_mode, num_tokens=p["num_tokens"], num_seqs=p["num_seqs"],
                            cu_seqlens=mb["cu_seqlens"] if seq_mode else None,
                            loss_scale_factor=self.cfg.data.max_response_length
                            if a.loss_agg_mode == "seq-mean-token-sum-norm" else None,
                            entropy_coeff=a.entropy_coeff, ref_log_prob=mb.get("ref_log_prob"),
                            kl_coef=a.kl_loss_coef if a.use_kl_loss else 0.0, kl_type=a.kl_loss_type,
                            process_group=self.model.tp_group, calculate_entropy=True)
                        mini_loss += loss.detach().double()
                        # A rank whose loss so far is not finite backpropagates NaN: DDP's reduction
                        # (in the last micro-batch's backward), FSDP's reduce-scatter or the norm's
                        # all-reduce then hands every rank a non-finite norm, and all of them skip
                        # the update together.
                        scale = torch.where(torch.isfinite(mini_loss), dp_scale, float("nan")).to(loss.dtype)
                        (loss * scale).backward()
                        ntok = mb["mask"].sum().double()
                        has_kl = has_kl or "kl_loss" in m
                        acc += torch.stack([m["pg_loss"].double(), m.get("kl_loss", m["pg_loss"] * 0).double(),
                                            *(m[k].double() * ntok
                                              for k in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl")),
                                            (m["entropy"].double() * mb["mask"]).sum(), ntok])
                self._poison_grads_unless_finite(mini_loss)
                loss_val, norm = torch.stack([mini_loss, self._clip_grads().double()]).tolist()
                loss_sum, norm_sum = loss_sum + loss_val, norm_sum + norm
                if math.isfinite(norm) and math.isfinite(loss_val):
                    self.optimizer.step()
                    n_updates += 1
                else:  # not applied: the weights and Adam's moments stay as they were
                    what = f"loss {loss_val}" if not math.isfinite(loss_val) else f"gradient norm {norm}"
                    skipped.append(f"epoch {epoch + 1} mini-batch {i + 1}: non-finite {what}")
        if n_updates:  # a step with no applied update does not advance the LR schedule
            self.scheduler.step()
        timing["timing_s/update_actor"] = time.perf_counter() - t0
        if self.grad_ranks > 1:  # the norm is identical on every rank: only the per-rank sums are summed
            acc = torch.cat([acc, torch.tensor([loss_sum], dtype=torch.float64, device=acc.device)])
            acc = acc.to(self.comm_device)
            dist.all_reduce(acc, group=self.grad_group)
            *sums, loss_sum = acc.tolist()
        else:
            sums = acc.tolist()
        s = dict(zip(_DEVICE_SUMS, sums))
        n_mini = a.ppo_epochs * len(plan)
        out = {"actor/loss": loss_sum / n_mini, "actor/pg_loss": s["pg_loss"] / n_mini,
               "actor/grad_norm": norm_sum / n_mini, "actor/lr": self.optimizer.param_groups[0]["lr"],
               "actor/num_updates": n_updates, "actor/skipped_updates": len(skipped)}
        if skipped:
            out["actor/skip_reason"] = "; ".join(skipped)
        for key in _TOKEN_AVG:
            out[f"actor/{key}"] = s[key] / max(s["tokens"], 1.0)
        if has_kl:
            out["actor/kl_loss"] = s["kl_loss"] / n_mini
        out.update(timing)
        if a.use_dynamic_bsz:  # the micro-batch token cap and how full it keeps this rank's micro-batches
            n_micro, cap = sum(len(p["micro"]) for p in plan), plan[0]["max_token_len"]
            out.update({"actor/max_token_len": float(cap), "actor/num_micro_batches": float(n_micro),
                        "actor/micro_batch_utilization": sum(p["tokens"] for p in plan) / (n_micro * cap)})
        return out

    def _poison_grads_unless_finite(self, loss: torch.Tensor) -> None:
        """Add NaN to this rank's gradients when ``loss`` is not finite, else 0 (no host read)."""
        poison = torch.where(torch.isfinite(loss), 0.0, float("nan")).float()
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.add_(poison)  # a 0-dim tensor operand: a foreach op would read it on the CPU

    def _clip_grads(self) -> torch.Tensor:
        """Clip to ``actor.grad_clip`` by the norm of the full (unsharded) gradient; return the norm
        (a 0-dim tensor on the device: nothing is read here)."""
        from torch.distributed.tensor import DTensor

        clip = self.actor_cfg.grad_clip
        if self.tp == 1:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
            # FSDP2: the norm of DTensor gradients is a (replicated) DTensor; read as a plain tensor.
            return norm.full_tensor() if isinstance(norm, DTensor) else norm

        # Squared norms of this rank's gradients: [0] of the parameters sharded over the TP group,
        # [1] of those replicated over it. Under FSDP2 the gradients are DTensors sharded over the DP
        # ranks too: their local shards are summed over the DP group first.
        sharded = tp_shard_dims(self.model)
        sq = torch.zeros(2, dtype=torch.float64, device=self.comm_device)
        grads, fsdp = [], False
        for name, p in self.model.named_parameters():
            if p.grad is not None:
                g = p.grad
                if isinstance(g, DTensor):
                    g, fsdp = g.to_local(), True
                sq[0 if name in sharded else 1] += g.double().pow(2).sum()
                grads.append(g)
        if fsdp:
            dist.all_reduce(sq, group=self.dp_group)
        shard_sq = sq[:1].clone()
        dist.all_reduce(shard_sq, group=self.tp_group)
        norm = (shard_sq[0] + sq[1]).sqrt()
        coef = (clip / (norm + 1e-6)).clamp(max=1.0).float()  # as clip_grad_norm_, on the device
        for g in grads:  # local shards: scaling them scales the DTensors
            g.mul_(coef)
        return norm

    def sync_weights(self) -> None:
        if self.rollout_model is not self.model:  # the replica (SP; multi-turn under FSDP2 with DP > 1)
            self.rollout_model.load_state_dict(full_state_dict(self.model))
        self.engine.update_weights(self.rollout_model)

    def _join_lockstep(self, max_new_tokens: int) -> None:
        """A rank without prompts joins the FSDP2 sampler's per-layer gathers of its peers."""
        if getattr(self.engine, "lockstep_group", None) is not None:
            self.engine.generate([], 1, max_new_tokens)

    # ------------------------------------------------------------------ validation
    def validate(self) -> Dict[str, float]:
        """Greedy (``rollout.val_kwargs``) decoding of the validation rows, split over the
        data-parallel replicas (the ranks of a TP group sample the same rows together)."""
        if not self.val_rows:
            return {}
        d, vk = self.cfg.data, self.rollout_cfg.val_kwargs
        q = dist.get_rank(self.dp_group) if self.dp > 1 else 0
        mine = list(range(q, len(self.val_rows), self.dp))
        most = -(-len(self.val_rows) // self.dp)  # every replica runs as many batches (FSDP2 lockstep)
        sums = torch.zeros(4, dtype=torch.float64)
        for start in range(0, most, d.val_batch_size):
            idx = mine[start:start + d.val_batch_size]
            if not idx:
                self._join_lockstep(d.max_response_length)
                continue
            rows = [self.val_rows[i] for i in idx]
            out, _ = self._rollout(idx, rows, self.val_rows, None, vk.n, vk.temperature, vk.top_p,
                                   self._seed(self.global_step, -1))
            score, acc, _ = self._score(out, rows)
            sums += torch.tensor([sum(score), sum(acc), float(out.lengths.sum()), len(score)], dtype=torch.float64)
        if self.dp > 1:
            sums = sums.to(self.comm_device)
            dist.all_reduce(sums, group=self.dp_group)
        score, acc, length, n = sums.tolist()
        n = max(n, 1.0)
        return {"val/score": score / n, "val/acc": acc / n, "val/response_length": length / n}

    # ------------------------------------------------------------------ loop
    def train_step(self) -> Dict[str, float]:
        """One DAPO step; returns its metrics (without validation)."""
        step = self.global_step + 1
        t0 = time.perf_counter()
        batch, metrics = self.collect(step)
        metrics.update(self.update(batch))
        self.nonfinite_streak = self.nonfinite_streak + 1 if metrics["actor/skipped_updates"] else 0
        if metrics["actor/skipped_updates"] and self.rank == 0:
            logger.warning("step %d: update skipped: %s", step, metrics["actor/skip_reason"])
        t1 = time.perf_counter()
        self.sync_weights()
        metrics["timing_s/update_weights"] = time.perf_counter() - t1
        metrics.update(batch_metrics(batch, self.cfg.data.max_response_length))
        metrics["timing_s/step"] = time.perf_counter() - t0
        metrics["perf/tokens_per_s"] = metrics["train/gen_tokens"] / max(metrics["timing_s/step"], 1e-9)
        self.global_step = step
        return metrics

    def save(self) -> str:
        state = {"step": self.global_step, "cursor": self.cursor.state_dict(),
                 "accumulator": ckpt.accumulator_state(self.accumulator), "nonfinite_streak": self.nonfinite_streak}
        full = full_state_dict(self.model)  # (the plain state_dict when nothing is sharded)
        return ckpt.save_checkpoint(self.ckpt_root, self.global_step, model=self.model, full_state=full,
                                    optimizer=self.optimizer, scheduler=self.scheduler, trainer_state=state,
                                    model_src_dir=self.cfg.actor_rollout_ref.model.path)

    def fit(self) -> Dict[str, float]:
        """Train to ``trainer.total_training_steps``; returns the last step's metrics."""
        t = self.cfg.trainer
        log = MetricsLogger(self.run_dir, t.total_training_steps, start_step=self.global_step,
                            enabled=self.rank == 0, progress_bar=t.progress_bar,
                            tensorboard="tensorboard" in t.logger)
        metrics: Dict[str, float] = {}
        try:
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
        finally:
            log.close()
        return metrics


def scaled_token_len(base: int, mean_turns: float, cfg, longest: int) -> int:
    """The micro-batch token cap for a batch averaging ``mean_turns`` assistant turns per
    response (:class:`~dapo_trainer.config.DynamicTokenLenConfig` ``cfg``): ``base`` times
    ``cfg.long_factor`` at ``mean_turns >= cfg.long_turns``, times ``cfg.short_factor`` at
    ``<= cfg.short_turns``, unscaled in between; at most ``cfg.max_token_len`` (the memory
    ceiling; None: ``base``), at least ``longest`` (every sequence fits a micro-batch)."""
    factor = (cfg.long_factor if mean_turns >= cfg.long_turns else
              cfg.short_factor if mean_turns <= cfg.short_turns else 1.0)
    ceiling = base if cfg.max_token_len is None else cfg.max_token_len
    return max(longest, min(ceiling, int(base * factor)))


def masked_log_probs(model, mb: dict, temperature: float) -> torch.Tensor:
    """Log-probs ``[T]`` of ``mb``'s labels where its mask is set (``mb["mask_index"]``), 0 elsewhere.

    The packed forward runs over every position (prompt and environment tokens are the
    context of the sampled ones), but the vocabulary projection and log-softmax, the costly
    part at a real vocabulary, run only on the masked rows: prompt tokens, environment turns
    and padding are never projected. The loss selects the masked positions away, so the
    zeros elsewhere are never read.
    """
    hidden = model(mb["input_ids"], mb["cu_seqlens"], mb["max_seqlen"])
    idx = mb["mask_index"]
    lp, _ = model.log_probs(hidden.index_select(0, idx), mb["labels"].index_select(0, idx), temperature=temperature)
    return lp.new_zeros(hidden.shape[0]).index_copy_(0, idx, lp)


def batch_metrics(batch, max_response_length: int) -> Dict[str, float]:
    """Reward, accuracy and length statistics of the train batch."""
    rl = batch["response_len"].double()
    return {"critic/score/mean": float(batch["score"].mean()), "critic/rewards/mean": float(batch["reward"].mean()),
            "critic/advantages/mean": float(batch["advantages"].mean()), "acc/mean": float(batch["acc"].mean()),
            "response_length/mean": float(rl.mean()), "response_length/max": float(rl.max()),
            "response_length/min": float(rl.min()),
            "response_length/clip_ratio": float(batch["truncated"].double().mean()),
            # Responses that carry a gradient (GRPO: all-equal groups have zero advantage).
            "train/effective_batch": float((batch["advantages"] != 0).sum()),
            "prompt_length/mean": float(batch["prompt_len"].double().mean()),
            "train/num_tokens": float(batch["response_mask"].sum())}
