"""The generation stage of a DAPO step: sample, reward and filter until a train batch is full.

Each data-parallel replica (a TP x SP group) samples and rewards a contiguous share of the
generation batch's prompts, whole groups, with the random streams the whole batch would draw
(``prompt_offset``); the shares (:class:`RolloutShare`) are all-gathered, so every rank holds the
same batch and dynamic sampling (``dk.group_filter``, ``dk.DynamicBatchAccumulator``) decides
identically everywhere. Multi-turn rollouts are split the same way, but their later turns draw
streams keyed by the replica's own engine calls: with an environment, 1 and 2 replicas sample
differently.
"""
from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

import dapo_kernels as dk

from . import data as data_mod
from . import rewards, rollout_dump
from .adaptive_sampling import SamplingController, memory_ceiling, round_counts, short_batch_groups
from .agent_loop import Episodes, build_agent_loop
from .parallel import ParallelDims
from .records import GenerationBatch, RolloutShare, TrainBatch

# The accumulator's statistics of a step, under the trainer's metric names.
_SAMPLING_METRICS = {
    "train/num_gen_batches": "dynamic_sampling/gen_batches", "train/seen_groups": "dynamic_sampling/groups_seen",
    "train/kept_groups": "dynamic_sampling/groups_kept", "train/keep_rate": "dynamic_sampling/keep_rate",
    "train/all_correct_groups": "dynamic_sampling/groups_all_correct",
    "train/all_wrong_groups": "dynamic_sampling/groups_all_wrong",
    "train/carried_in_groups": "dynamic_sampling/groups_carried_in",
    "train/carried_over_groups": "dynamic_sampling/groups_carried_over",
}
_TIMINGS = ("timing_s/gen", "timing_s/reward", "timing_s/filter")
logger = logging.getLogger(__name__)
# Accumulator keys of older checkpoints -> the TrainBatch field each holds ("truncated": ~stopped).
_OLD_KEYS = {"rollout_log_prob": "log_probs", "response_mask": "sampled", "num_turns": "turns"}


@dataclass
class _SampledShare:
    """A replica's share of a generation batch and what it measured of it."""

    share: RolloutShare
    timing: Dict[str, float]
    turn_stats: Dict[str, float]
    components: List[dict]


def stream_seed(base: int, step: int, k: int) -> int:
    """The sampler's seed of generation batch ``k`` of ``step`` (-1: validation, -2: the batch pick)."""
    return (base * 1_000_003 + step * 10_007 + k) % (2 ** 62)


class GenerationStage:
    """Prompts, rollout, rewards and dynamic sampling; ``collect(step)`` returns a full train batch.

    Owns the data cursor and the dynamic-sampling accumulator (both checkpointed: ``state_dict``).
    """

    def __init__(self, cfg, dims: ParallelDims, tokenizer, engine, train_rows: List[dict], env=None, *,
                 prompt_cache: Optional[Dict[int, List[int]]] = None, routes: int = 0):
        self.cfg, self.dims, self.tokenizer, self.engine = cfg, dims, tokenizer, engine
        # Router replay R3: expert ids per token the engine records (sparse layers x num_experts_per_tok), else 0.
        self.routes = routes
        self.rollout_cfg = cfg.actor_rollout_ref.rollout
        self.train_rows = train_rows
        d, fg = cfg.data, cfg.algorithm.filter_groups
        self.loop = build_agent_loop(cfg, tokenizer, engine, env)
        # Prompt ids by train row (data.encode_rows fills it on load); rows missing from it are encoded when drawn.
        self._prompt_cache: Dict[int, List[int]] = {} if prompt_cache is None else prompt_cache
        self.cursor = data_mod.BatchCursor(len(train_rows), cfg.gen_batch_size, seed=cfg.trainer.seed,
                                           shuffle=d.shuffle)
        # short_batch: the stage stops at max_num_gen_batches itself (collect), the accumulator never raises.
        self.max_rounds = fg.max_num_gen_batches if fg.enable else 0
        self.accumulator = dk.DynamicBatchAccumulator(
            d.train_batch_size, self.rollout_cfg.n, self.max_rounds if fg.on_exhausted == "error" else 0,
            carry_over=fg.carry_over)
        self.sources = [str(row.get("data_source", "")) for row in train_rows]
        ceiling = memory_ceiling(cfg, dims) if fg.adaptive else len(train_rows)
        self.sampling = SamplingController(cfg, dp=dims.rollout_ranks, ceiling=min(ceiling, len(train_rows)))

    def state_dict(self) -> dict:
        return {"cursor": self.cursor.state_dict(), "accumulator": self.accumulator.state_dict(),
                "sampling": self.sampling.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.cursor.load_state_dict(state["cursor"])
        acc, n = _with_routing_column(_renamed_accumulator_state(state["accumulator"])), self.rollout_cfg.n
        saved_n = dk.DynamicBatchAccumulator.state_n_per_prompt(acc)
        if saved_n not in (None, n):  # groups of another rollout.n cannot join this run's train batches
            if self.dims.rank == 0:
                logger.warning("the checkpoint carries over %d kept groups of actor_rollout_ref.rollout.n=%s "
                               "responses each; this run has rollout.n=%d: they are dropped, the next step samples "
                               "afresh", acc["num_buffered_groups"], saved_n, n)
            acc = {**acc, "chunks": [], "keys": None, "num_buffered_groups": 0, "carried_in": 0}
        self._check_carried_widths(acc)
        self.accumulator.load_state_dict(acc)
        if "sampling" in state:  # (checkpoints from before adaptive sampling start its estimate afresh)
            self.sampling.load_state_dict(state["sampling"])

    def _check_carried_widths(self, acc_state: dict) -> None:
        """Groups carried over are padded to the lengths of the run that sampled them: they join this
        run's train batch only at the same data.max_prompt_length and data.max_response_length."""
        d = self.cfg.data
        for chunk in acc_state.get("chunks") or []:
            if not isinstance(chunk, dict):
                continue  # the accumulator's load_state_dict names what is wrong with it
            routed = getattr(chunk.get("routed_experts"), "shape", (0, 0))[1]
            want = (d.max_prompt_length + d.max_response_length) * self.routes
            if routed != want:
                mode = self.cfg.actor_rollout_ref.actor.router_replay.mode
                raise ValueError(
                    f"actor_rollout_ref.actor.router_replay.mode={mode}: "
                    f"the checkpoint being resumed carries kept groups with {routed} routing ids per row, this run "
                    f"records {want}: resume with the router replay mode that sampled them, or from a checkpoint "
                    "that carries no group (train/carried_over_groups 0)")
            for key, column, want in (("data.max_prompt_length", "prompt_ids", d.max_prompt_length),
                                      ("data.max_response_length", "response_ids", d.max_response_length)):
                have = getattr(chunk.get(column), "shape", (0, want))[1]
                if have != want:
                    raise ValueError(
                        f"{key}={want}, but the checkpoint being resumed carries {acc_state['num_buffered_groups']} "
                        f"kept groups over to its next step, sampled with {key}={have}: resume with {key}={have}, "
                        "or from a checkpoint that carries no group (train/carried_over_groups 0)")

    def seed(self, step: int, k: int) -> int:
        return stream_seed(self.cfg.trainer.seed, step, k)

    # ------------------------------------------------------------------ rollout + reward
    def rollout(self, *, rows: List[dict], keys: List[int], cache: Optional[dict] = None, n: int, temperature: float,
                top_p: float, seed: int, prompt_offset: int = 0) -> Episodes:
        """``n`` responses to each of ``rows`` (``keys``: their indices in the data, the keys of the
        prompt ``cache``); ``prompt_offset``: index of the first row in the whole generation batch."""
        return self.loop.run(rows=rows, keys=keys, cache=cache, n=n, temperature=temperature, top_p=top_p, seed=seed,
                             prompt_offset=prompt_offset)

    def score(self, episodes: Episodes, rows: List[dict]):
        """Rewards of every response: (score, acc, components) lists."""
        return self.loop.score(episodes, rows)

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

    def join_lockstep(self, max_new_tokens: int) -> None:
        """A rank without prompts joins the FSDP2 sampler's per-layer gathers of its peers."""
        if getattr(self.engine, "lockstep_group", None) is not None:
            self.engine.generate([], 1, max_new_tokens)

    def _sample_share(self, idx: List[int], rows: List[dict], offset: int, seed: int) -> _SampledShare:
        """Sample, reward and measure this replica's share of a generation batch (rows ``idx`` of
        the data, from index ``offset`` of the batch)."""
        d, r = self.cfg.data, self.rollout_cfg
        R, P = d.max_response_length, d.max_prompt_length
        if not rows:  # more replicas than prompts: this one only receives
            self.join_lockstep(R)
            return _SampledShare(RolloutShare.empty(P, R, self.routes), {"timing_s/gen": 0.0, "timing_s/reward": 0.0},
                                 {}, [])
        t0 = time.perf_counter()
        ep = self.rollout(rows=rows, keys=idx, cache=self._prompt_cache, n=r.n, temperature=r.temperature,
                          top_p=r.top_p, seed=seed, prompt_offset=offset)
        t1 = time.perf_counter()
        score, acc, comps = self.score(ep, rows)
        out, prompts = ep.out, ep.prompts
        score = torch.tensor(score, dtype=torch.float64)
        acc = torch.tensor(acc, dtype=torch.float64)
        lengths, N = out.lengths, len(score)
        final = score.clone()
        ob = self.cfg.reward_model.overlong_buffer
        if ob.enable:
            final += dk.overlong_penalty(lengths, R, ob.len, ob.penalty_factor).double()
        metric = self._filter_metric(score, acc, final, comps)  # binarised by the step's threshold after the gather
        failed = torch.zeros(N, dtype=torch.bool)
        failed[list(getattr(out, "errors", {}))] = True
        pad = self.tokenizer.pad_token_id
        groups = out.group_index.tolist()
        prompt_ids = torch.full((N, P), pad, dtype=torch.int64)
        for k, g in enumerate(groups):
            prompt_ids[k, :len(prompts[g])] = torch.tensor(prompts[g], dtype=torch.int64)
        valid = torch.arange(R)[None, :] < lengths[:, None]
        response_ids = torch.full((N, R), pad, dtype=torch.int64)
        response_ids[valid] = out.response_ids
        log_probs = torch.zeros(N, R, dtype=torch.float32)
        log_probs[valid] = out.log_probs.float()
        sampled = torch.zeros(N, R, dtype=torch.bool)
        mask = getattr(out, "response_mask", None)
        sampled[valid] = True if mask is None else mask.bool()
        routed = torch.full((N, P + R, self.routes), -1, dtype=torch.int64)
        if self.routes:  # R3: the engine's [T', L, k] in sequences() order, into prompt / response columns
            flat = out.routed_experts.reshape(-1, self.routes)
            start = 0
            for k, g in enumerate(groups):
                pl, rl = len(prompts[g]), int(lengths[k])
                routed[k, :pl] = flat[start:start + pl]
                routed[k, P:P + rl] = flat[start + pl:start + pl + rl]
                start += pl + rl
        share = RolloutShare(
            prompt_ids=prompt_ids, response_ids=response_ids, log_probs=log_probs, sampled=sampled,
            prompt_len=torch.tensor([len(prompts[g]) for g in groups], dtype=torch.int64), response_len=lengths,
            stopped=torch.tensor([f == "stop" for f in out.finish_reasons], dtype=torch.bool), score=score, acc=acc,
            reward=final, filter_metric=metric, failed=failed, turns=torch.tensor(ep.turns, dtype=torch.float64),
            routed_experts=routed.reshape(N, -1))
        timing = {"timing_s/gen": t1 - t0, "timing_s/reward": time.perf_counter() - t1}
        return _SampledShare(share, timing, ep.turn_stats, comps)

    def _gather_shares(self, share: RolloutShare, rows_per_replica: List[int]) -> RolloutShare:
        """Every replica's share, in replica order (one all-gather over the DP group, on its device)."""
        table = share.pack()
        if self.dims.rollout_ranks > 1:
            buf = table.new_zeros(max(rows_per_replica), table.shape[1], device=self.dims.comm_device)
            buf[:table.shape[0]] = table.to(self.dims.comm_device)
            parts = [torch.empty_like(buf) for _ in range(self.dims.rollout_ranks)]
            dist.all_gather(parts, buf, group=self.dims.rollout_group)
            table = torch.cat([p[:m] for p, m in zip(parts, rows_per_replica)]).cpu()
        d = self.cfg.data
        return RolloutShare.unpack(table, d.max_prompt_length, d.max_response_length, self.routes)

    def generation_batch(self, step: int, k: int) -> GenerationBatch:
        """Generate, reward and filter one generation batch of ``cursor.batch_size`` prompts; rows padded
        to fixed widths."""
        n, dp = self.rollout_cfg.n, self.dims.rollout_ranks  # DP replicas, or every replica-holding rank
        idx = self.cursor.next_batch()
        B = len(idx)
        bounds = [B * q // dp for q in range(dp + 1)]
        q = self.dims.rollout_rank
        lo, hi = bounds[q], bounds[q + 1]
        mine = self._sample_share(idx[lo:hi], [self.train_rows[i] for i in idx[lo:hi]], lo, self.seed(step, k))
        timing = mine.timing
        t0 = time.perf_counter()
        s = self._gather_shares(mine.share, [(bounds[i + 1] - bounds[i]) * n for i in range(dp)])
        timing["timing_s/gen"] += time.perf_counter() - t0
        t2 = time.perf_counter()
        algo = self.cfg.algorithm
        metric = rewards.binarize(s.filter_metric, self.sampling.threshold.value(step))
        adv = dk.group_filter(s.reward, group_size=n, norm_adv_by_std=algo.norm_adv_by_std_in_grpo).check()
        if algo.filter_groups.enable:
            keep = dk.group_filter(metric, group_size=n).check().keep
        else:
            keep = torch.ones(len(s.reward), dtype=torch.bool)
        group_index = torch.arange(B, dtype=torch.int64).repeat_interleave(n)
        failed = s.failed.view(B, n).any(1)
        keep = keep & ~failed.repeat_interleave(n)  # on_error=drop: never train on failed groups
        batch = TrainBatch.of(s, adv.advantages.float(), group_index)
        timing["timing_s/filter"] = time.perf_counter() - t2
        return GenerationBatch(
            batch=batch, keep=keep, metric=metric, raw_metric=s.filter_metric, rows=idx, turn_stats=mine.turn_stats,
            timing=timing, tokens=int(s.prompt_len.sum() + s.response_len.sum()),
            local_tokens=int(mine.share.response_len.sum()),
            components={lo * n + i: c for i, c in enumerate(mine.components)}, failed_groups=failed.sum())

    def collect(self, step: int) -> Tuple[TrainBatch, Dict[str, float]]:
        """Fill a train batch by dynamic sampling. Returns (batch, metrics)."""
        # A step whose train batch the carried-over groups fill generates nothing: its timings are 0, not missing.
        timing, tokens, local_tokens, k = dict.fromkeys(_TIMINGS, 0.0), 0, 0, 0
        turn_stats = defaultdict(float)
        dump = [] if self.cfg.trainer.rollout_data_dir and self.dims.rank == 0 else None
        truncated = sampled = prompts = 0  # over every generated response, kept or not
        fg, n, acc = self.cfg.algorithm.filter_groups, self.rollout_cfg.n, self.accumulator
        raw_metrics, warned, failed_groups = [], False, 0
        while not acc.ready:
            if fg.on_exhausted == "short_batch" and 0 < self.max_rounds <= k:
                break
            self.cursor.batch_size = self.sampling.gen_size(acc.num_buffered_groups, k)
            gb = self.generation_batch(step, k)
            k += 1
            prompts += len(gb.rows)
            raw_metrics.append(gb.raw_metric)
            if dump is not None:
                dump.append(gb)
            for key, v in gb.turn_stats.items():
                turn_stats[key] += v
            for key, v in gb.timing.items():
                timing[key] += v
            tokens += gb.tokens
            local_tokens += gb.local_tokens
            truncated += int((~gb.batch.stopped).sum())
            sampled += len(gb.batch.stopped)
            t0 = time.perf_counter()
            self.sampling.observe_round(round_counts([self.sources[i] for i in gb.rows], gb.keep))
            failed_groups = failed_groups + gb.failed_groups
            try:
                acc.add(gb.batch.tensors(), gb.batch.group_index, gb.keep, scores=gb.metric)
            except dk.DynamicSamplingExhausted as e:
                # The accumulator sees only kept / dropped, not why: the threshold or environment errors.
                note = self.sampling.threshold_note(step, raw_metrics)
                why = (f" But {note}." if note else "") + (
                    f" Groups dropped for environment errors (environment.on_error=drop): {int(failed_groups)}."
                    if int(failed_groups) else "")
                if why:
                    raise dk.DynamicSamplingExhausted(f"{e}{why}") from None
                raise
            if self.max_rounds <= 0 and fg.enable and not acc.ready and prompts >= len(self.train_rows) and \
                    not acc.metrics()["dynamic_sampling/groups_kept"]:  # unlimited rounds would never end
                raise dk.DynamicSamplingExhausted(
                    f"{acc.exhausted_message()} With max_num_gen_batches={fg.max_num_gen_batches} (unlimited) a step "
                    f"stops once a whole pass over the {len(self.train_rows)} training rows keeps no group: look at "
                    "the reward function and algorithm.filter_groups.metric, which were the same within every group")
            if not warned and fg.enable and not acc.ready:
                warned = self.sampling.warn_if_exhausting(acc, step, k, len(gb.rows), self.max_rounds,
                                                          log=self.dims.rank == 0,
                                                          cause=self.sampling.threshold_note(step, raw_metrics))
            timing["timing_s/filter"] += time.perf_counter() - t0
        if dump:
            self._dump_rollouts(step, dump)
        short = not acc.ready
        if short and acc.num_buffered_groups == 0:
            note = self.sampling.threshold_note(step, raw_metrics)
            raise dk.DynamicSamplingExhausted(acc.exhausted_message(self.max_rounds) + " (on_exhausted=short_batch: "
                                              "no group to train on)" + (f" But {note}." if note else ""))
        batch = TrainBatch.from_tensors(acc.take(
            fg.prefer, "response_len", seed=self.seed(step, -2),
            num_groups=short_batch_groups(acc.num_buffered_groups, self.cfg.actor_rollout_ref.actor.ppo_mini_batch_size)
            if short else None))
        threshold = self.sampling.threshold.value(step)
        if raw_metrics:
            self.sampling.threshold.observe(torch.cat(raw_metrics), n)
        am = acc.last_metrics
        metrics = {ours: am[theirs] for ours, theirs in _SAMPLING_METRICS.items()}
        metrics.update(self.sampling.step_metrics(
            rounds=k, prompts=prompts, responses=sampled, kept=am["dynamic_sampling/groups_kept"],
            discarded=am["dynamic_sampling/groups_discarded"], n=n, buffered=acc.num_buffered_groups,
            threshold=threshold))
        metrics["sampling/short_batch"] = float(short)
        metrics["sampling/warned"] = float(warned)
        metrics.update({
            "train/gen_tokens": tokens, "train/gen_responses": sampled,
            # Cut at max_response_length among all sampled responses (the train batch's own rate,
            # response_length/clip_ratio, sees only the kept groups under dynamic sampling).
            "train/gen_truncated_frac": truncated / max(sampled, 1),
            # Response tokens this rank's replica sampled: about 1 / DP of the batch's.
            "train/local_response_tokens": local_tokens,
        })
        metrics.update(timing)
        # Per-turn statistics of the generated dialogues (means over the generation batches; counts summed).
        metrics.update({key: v / k if not key.endswith("tokens") and key != "dialog/env_errors" else v
                        for key, v in turn_stats.items()})
        return batch, metrics

    def _dump_rollouts(self, step: int, gbs: List[GenerationBatch]) -> None:
        """Write ``trainer.rollout_data_dir/{step}.jsonl`` (format: :mod:`dapo_trainer.rollout_dump`)."""
        t, n = self.cfg.trainer, self.rollout_cfg.n
        rows = []
        picks = rollout_dump.spread_groups([len(gb.keep) // n for gb in gbs], n, t.rollout_data_max_rows)
        for k, g in picks:
            gb = gbs[k]
            x = gb.batch
            for j in range(g * n, (g + 1) * n):
                pl, rl = int(x.prompt_len[j]), int(x.response_len[j])
                ids = x.response_ids[j, :rl].tolist()
                comps = {c: v for c, v in gb.components.get(j, {}).items() if isinstance(v, (int, float, str))}
                rows.append({"step": step, "gen_batch": k, "group": g, "sample": j - g * n,
                             "prompt": self.tokenizer.decode(x.prompt_ids[j, :pl].tolist()),
                             "response": self.tokenizer.decode(ids), "response_ids": ids, "response_length": rl,
                             "finish_reason": "stop" if bool(x.stopped[j]) else "length",
                             "score": float(x.score[j]), "acc": float(x.acc[j]),
                             "reward": float(x.reward[j]), "filter_metric": float(gb.metric[j]),
                             "components": comps, "kept": bool(gb.keep[j])})
        rollout_dump.write_step(t.rollout_data_dir, step, rows)


def _with_routing_column(state: dict) -> dict:
    """``state`` with an empty ``routed_experts`` column in chunks saved before the column existed."""
    keys, chunks = (state.get("keys"), state.get("chunks")) if isinstance(state, dict) else (None, None)
    if not isinstance(keys, (list, tuple)) or "routed_experts" in keys or not isinstance(chunks, (list, tuple)) \
            or not all(isinstance(c, dict) and "prompt_len" in c for c in chunks):
        return state  # (the accumulator's load_state_dict names what is wrong with a malformed state)
    chunks = [{**c, "routed_experts": torch.zeros(len(c["prompt_len"]), 0, dtype=torch.int64)} for c in chunks]
    return {**state, "chunks": chunks, "keys": tuple(sorted({*keys, "routed_experts"}))}


def _renamed_accumulator_state(state: dict) -> dict:
    """``state`` with its chunks keyed by :class:`TrainBatch`'s field names (``truncated``: ``~stopped``)."""
    keys, chunks = (state.get("keys"), state.get("chunks")) if isinstance(state, dict) else (None, None)
    if not isinstance(keys, (list, tuple)) or "truncated" not in keys or not isinstance(chunks, (list, tuple)) \
            or not all(isinstance(c, dict) and "truncated" in c for c in chunks):
        return state  # (the accumulator's load_state_dict names what is wrong with a malformed state)

    def rename(chunk):
        out = {_OLD_KEYS.get(k, k): v for k, v in chunk.items() if k != "truncated"}
        out["stopped"] = ~chunk["truncated"]
        return out

    keys = tuple(sorted({_OLD_KEYS.get(k, k) for k in state["keys"] if k != "truncated"} | {"stopped"}))
    return {**state, "chunks": [rename(c) for c in state["chunks"]], "keys": keys}
