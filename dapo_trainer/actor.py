"""The actor update of a DAPO step: plan, pack, log-probs, loss, clip, optimizer step.

Per mini-batch: sequences balanced over data-parallel ranks (``dk.balanced_partitions``),
token-capped micro-batches (``dk.micro_batches``, balanced by attention workload; the cap is per
rank, so an SP group's micro-batch holds SP times as many tokens) packed through the model,
``dk.fused_linear_policy_loss`` normalised by the mini-batch's global token count, gradients
averaged over the gradient ranks by torch's DDP (once per mini-batch: the micro-batches before
the last accumulate under ``no_sync``) or FSDP2, clipping, AdamW with warmup. An update whose
loss or gradient norm is not finite is skipped.

Rollout correction (``algorithm.rollout_correction``, with ``rollout.calculate_log_probs``), verl
0.9.1's two modes: decoupled (default), after the old-log-prob pass ``dk.rollout_correction`` of the
old vs the rollout's log-probs over the whole train batch (``[N, R]``, as verl's driver), its IS
weights and rejection-masked response mask handed to every micro-batch's loss; ``bypass_mode``, no
old-log-prob pass, the rollout's log-probs are the old ones and each micro-batch is corrected against
the current policy inside the update (verl's ``compute_policy_loss_bypass_mode``, PPO-clip).

Mixture-of-experts models (Qwen3-MoE): every training forward's routing is traced
(:class:`~dapo_trainer.router_load.RouterLoad`): the ``actor/moe_*`` load metrics, and the router's
load-balancing loss, added to each micro-batch's loss times ``actor.router_aux_loss_coef`` (0: off)
and its share of the mini-batch's tokens over all ranks (so a mini-batch adds the token-weighted mean
of its micro-batches' losses; each is a micro-batch's own, as Megatron's, so its value depends on how
the micro-batches are cut). Not under PP (:class:`PipelinedActor` traces nothing).
Router replay (``actor.router_replay.mode``, verl's): R2, the old-log-prob forward records each
micro-batch's routing (``MicroBatch.routed_experts``); R3, the rollout's routing (the train batch's
``routed_experts``) is packed with the micro-batch and the old-log-prob forward routes by it too; every
training forward of the micro-batch routes by it (``Transformer.replay_routing``, held through the
backward's recompute).
"""
from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import replace
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

import dapo_kernels as dk
from dapo_kernels.validation import to_device_checked

from .parallel import (ParallelDims, apply_ddp, balanced_dp_split, clip_grad_norm, expert_shard_names, shard_sequence,
                       sp_micro_batches, tp_grad_sync, tp_shard_dims)
from .model import PromptSharing
from .records import MicroBatch, MiniBatchPlan, TrainBatch
from .router_load import RouterLoad

# The loss's per-token fractions (its name: the metric's), summed times tokens over the update.
_LOSS_FRACTIONS = {"pg_clipfrac": "actor/pg_clipfrac", "pg_clipfrac_lower": "actor/pg_clipfrac_lower",
                   "ppo_kl": "actor/ppo_kl"}
# Metrics averaged over the update's response tokens.
_TOKEN_MEANS = (*_LOSS_FRACTIONS.values(), "actor/entropy")
# The update's metric sums kept on the device: per mini-batch means, token-weighted sums, and the token count.
_SUMS = ("actor/pg_loss", "actor/kl_loss") + _TOKEN_MEANS + ("tokens",)
# bypass_mode: micro-batches whose rollout_corr/* metrics the sums hold (verl averages them over micro-batches).
_CORRECTED = "rollout_corr_micro_batches"


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


def masked_log_probs(model, mb: MicroBatch, temperature: float) -> torch.Tensor:
    """Log-probs ``[T]`` of ``mb``'s labels where its mask is set (``mb.mask_index``), 0 elsewhere.

    The packed forward runs over every position (prompt and environment tokens are the
    context of the sampled ones), but the vocabulary projection and log-softmax, the costly
    part at a real vocabulary, run only on the masked rows (:func:`project_log_probs`).
    """
    return project_log_probs(model, model(mb.input_ids, mb.cu_seqlens, mb.max_seqlen, sharing=mb.sharing), mb,
                             temperature)


def project_log_probs(model, hidden: torch.Tensor, mb: MicroBatch, temperature: float) -> torch.Tensor:
    """Log-probs ``[T]`` of ``mb``'s labels from its hidden states, projected on the masked rows only:
    prompt tokens, environment turns and padding are never projected, and the loss selects the
    masked positions away, so the zeros elsewhere are never read."""
    idx = mb.mask_index
    lp, _ = model.log_probs(hidden.index_select(0, idx), mb.labels.index_select(0, idx), temperature=temperature)
    return lp.new_zeros(hidden.shape[0]).index_copy_(0, idx, lp)


def prompt_sharing(prompt_ids: torch.Tensor, keep: torch.Tensor) -> Optional[PromptSharing]:
    """The :class:`~dapo_trainer.model.PromptSharing` of rows packed from the ``[n, P + R]`` slot grid
    ``keep`` (prompt slots first): a row whose prompt (ids and length) an earlier row has reuses that
    row's prompt tokens. None when no two rows share a prompt. Host tensors in, host tensors out."""
    n, P = prompt_ids.shape
    # Ids are >= 0: -1 past the prompt makes the key tell lengths apart as well as tokens.
    key = torch.where(keep[:, :P], prompt_ids, -1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    row = torch.arange(n)
    leader = torch.full((n,), n).scatter_reduce_(0, inverse, row, "amin")[inverse]  # first row of each prompt
    if bool((leader == row).all()):
        return None
    computed = keep.clone()
    computed[:, :P] &= (leader == row)[:, None]
    source = torch.full(keep.shape, -1, dtype=torch.long)
    source[computed] = torch.arange(int(computed.sum()))
    source[:, :P] = source[leader, :P]  # a repeated prompt token is its first copy's row
    position = torch.full(keep.shape, -1, dtype=torch.long)
    position[keep] = torch.arange(int(keep.sum()))
    return PromptSharing(computed=position[computed], source=source[keep])


def pack_micro_batch(batch: TrainBatch, rows: List[int], device: torch.device, sp_group=None,
                     top_k: int = 1, share_prompts: bool = False) -> MicroBatch:
    """Prompt + response of ``rows`` end to end, labels shifted by one token; under sequence
    parallelism (``sp_group``) the labels, mask and advantages are this rank's token shard. With a
    ``routed_experts`` column (router replay R3; ``top_k``: experts per token), each sparse layer's
    ``[T, top_k]`` ids in the same token order. ``share_prompts``: rows repeating a prompt compute it
    once (:func:`prompt_sharing`; the positions and per-token fields keep the packed layout).

    Whole-tensor ops on the rows' ``[n, P + R]`` prompt-and-response grid (kept slots in row-major
    order are each row's prompt then its response), not a loop of small ops per row."""
    r = torch.as_tensor(rows, dtype=torch.long)
    pl, rl = batch.prompt_len[r], batch.response_len[r]
    P, R = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    col = torch.arange(P + R)
    in_prompt = col < P
    keep = torch.where(in_prompt, col < pl[:, None], col - P < rl[:, None])  # [n, P + R] slots of the sequences
    pos = torch.where(in_prompt, col, pl[:, None] + col - P)  # each slot's position in its sequence
    # Position t predicts token t + 1: response token k is predicted from position pl - 1 + k.
    k = pos - (pl[:, None] - 1)
    predicts = (k >= 0) & (k < rl[:, None])
    kc = k.clamp(0, R - 1)
    input_ids = torch.cat([batch.prompt_ids[r], batch.response_ids[r]], 1)[keep]
    mask = (predicts & batch.sampled[r].gather(1, kc))[keep]
    adv = batch.advantages[r].float()[:, None].expand(-1, P + R)[keep]
    cells = torch.where(predicts, r[:, None] * R + kc, -1)[keep]  # the [N, R] grid's cell each position predicts
    routed = None
    if batch.routed_experts.shape[1]:  # R3: the rollout's experts of each token ([N, (P + R) * layers * k] grid)
        grid = batch.routed_experts.view(len(batch.prompt_len), P + R, -1)[r][keep]
        flat = grid.view(input_ids.shape[0], -1, top_k)
        routed = tuple(flat[:, layer].to(device) for layer in range(flat.shape[1]))
    labels = torch.cat([input_ids[1:], input_ids.new_zeros(1)])
    lens = pl + rl
    cu = torch.zeros(len(rows) + 1, dtype=torch.int32)
    cu[1:] = lens.cumsum(0)
    if sp_group is not None:  # the model takes every token and computes this rank's shard; the loss reads that shard
        labels, mask, adv, cells = (shard_sequence(t, sp_group) for t in (labels, mask, adv, cells))
    mask_index = mask.nonzero().squeeze(1)
    sharing = prompt_sharing(batch.prompt_ids[r], keep) if share_prompts else None
    # ids, labels and cu_seqlens are checked here, on the host, so that the model and the loss
    # read nothing of them inside the micro-batch loop; the masked positions are listed here too
    # (a host tensor: no device read), for masked_log_probs.
    return MicroBatch(input_ids=to_device_checked(input_ids, device), labels=to_device_checked(labels, device),
                      mask=mask.to(device), mask_index=mask_index.to(device), advantages=adv.to(device),
                      cu_seqlens=to_device_checked(cu, device), max_seqlen=int(lens.max()),
                      response_index=cells[mask_index].to(device), routed_experts=routed,
                      sharing=None if sharing is None else PromptSharing(*(t.to(device) for t in sharing)))


def to_grid(packed: List[List[MicroBatch]], values: List[List[Optional[torch.Tensor]]], shape: Tuple[int, int],
            device: torch.device) -> torch.Tensor:
    """Per-token ``values`` (``[T]`` per micro-batch, None where this rank has none: a pipeline's
    earlier stages) at their masked positions, laid out in the train batch's ``[N, R]`` grid (0 at the
    cells this rank did not compute). Device ops only."""
    flat = torch.zeros(shape[0] * shape[1], dtype=torch.float32, device=device)
    for mbs, row in zip(packed, values):
        for mb, v in zip(mbs, row):
            if v is not None:
                flat.index_copy_(0, mb.response_index, v.index_select(0, mb.mask_index).to(flat.dtype))
    return flat.view(shape)


def from_grid(mb: MicroBatch, grid: torch.Tensor) -> torch.Tensor:
    """``grid``'s ``[N, R]`` values at ``mb``'s masked positions, as ``[T]`` (zeros / False elsewhere)."""
    flat = grid.reshape(-1)
    return flat.new_zeros(mb.mask.shape[0]).index_copy_(0, mb.mask_index, flat.index_select(0, mb.response_index))


def build_optimizer(model, optim_cfg, total_training_steps: int):
    """AdamW and its warmup schedule, ``actor_rollout_ref.actor.optim``."""
    o = optim_cfg
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                  weight_decay=o.weight_decay)
    warmup = o.lr_warmup_steps if o.lr_warmup_steps >= 0 else int(o.lr_warmup_steps_ratio * total_training_steps)
    # (s + 1) / warmup: the first update already moves the weights (step 0 is not spent at lr 0).
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup > 0 else 1.0)
    return optimizer, scheduler


def add_loss_metrics(sums: Dict[str, torch.Tensor], m: Dict[str, torch.Tensor], mask: torch.Tensor) -> None:
    """Add one micro-batch's loss metrics ``m`` to the step's device sums (fractions weighted by its
    tokens, so the step's value is the token-weighted mean)."""
    ntok = mask.sum().double()
    sums["actor/pg_loss"] += m["pg_loss"].double()
    sums["actor/kl_loss"] += m.get("kl_loss", m["pg_loss"] * 0).double()
    for theirs, ours in _LOSS_FRACTIONS.items():
        sums[ours] += m[theirs].double() * ntok
    sums["actor/entropy"] += (m["entropy"].double() * mask).sum()
    sums["tokens"] += ntok


class Actor:
    """The policy update: ``update(batch)`` trains the model on a train batch, returns ``actor/*`` metrics."""

    def __init__(self, cfg, dims: ParallelDims, model, ref_model=None, *, device: torch.device):
        a = self.actor_cfg = cfg.actor_rollout_ref.actor
        self.dims, self.model, self.ref_model, self.device = dims, model, ref_model, device
        self.n = cfg.actor_rollout_ref.rollout.n
        self.temperature = cfg.actor_rollout_ref.rollout.temperature
        # DDP averages the gradients over the gradient ranks in the backward (FSDP2 shards them);
        # the training forward runs through the wrapper, log-probs on the model itself.
        # (Under PP each stage is wrapped instead: PipelinedActor.)
        self.ddp = (apply_ddp(model, dims.grad_group) if dims.grad_ranks > 1 and a.strategy == "ddp" and dims.pp == 1
                    else None)
        self.optimizer, self.scheduler = build_optimizer(model, a.optim, cfg.trainer.total_training_steps)
        # The loss's options, fixed for the run (the per-micro-batch tensors and counts go in each call).
        self.loss_options = dict(
            temperature=self.temperature, loss_agg_mode=a.loss_agg_mode,
            clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high, clip_ratio_c=a.clip_ratio_c,
            loss_scale_factor=cfg.data.max_response_length if a.loss_agg_mode == "seq-mean-token-sum-norm" else None,
            entropy_coeff=a.entropy_coeff, calculate_entropy=True,
            kl_coef=a.kl_loss_coef if a.use_kl_loss else 0.0, kl_type=a.kl_loss_type,
            process_group=dims.loss_tp_group)
        # algorithm.rollout_correction runs when the rollout's log-probs are handed over (verl: when the batch
        # has rollout_log_probs), in verl's decoupled mode or its bypass_mode (the config refuses the rest).
        rc = cfg.algorithm.rollout_correction
        self.correct = cfg.actor_rollout_ref.rollout.calculate_log_probs
        self.bypass = self.correct and rc.bypass_mode
        # The loss's old log-probs are the rollout's (no old-log-prob forward): bypass_mode, or verl's
        # actor.use_rollout_log_probs without a correction (the config refuses it with decoupled mode).
        self.rollout_old = self.bypass or a.use_rollout_log_probs
        self.correction_options = dict(
            rollout_is=rc.rollout_is, rollout_is_threshold=rc.rollout_is_threshold,
            rollout_is_batch_normalize=rc.rollout_is_batch_normalize, rollout_rs=rc.rollout_rs,
            rollout_rs_threshold=rc.rollout_rs_threshold)
        # bypass_mode's metric names, summed on the device per micro-batch (the op's own names, from a 1-token call).
        one = torch.zeros(1, 1)
        self.bypass_metrics = list(dk.rollout_correction(one, one, one.bool(), **self.correction_options).metrics) \
            if self.bypass else []
        self.aux_coef = a.router_aux_loss_coef
        self.replay = a.router_replay.mode != "disabled"
        if self.replay and not model.sparse_blocks():
            raise ValueError(f"config key 'actor_rollout_ref.actor.router_replay.mode': {a.router_replay.mode!r} "
                             f"replays a mixture-of-experts model's routing; model_type {model.config.model_type!r} "
                             "has no sparse layer")

    def plan(self, batch: TrainBatch) -> List[MiniBatchPlan]:
        """Per mini-batch: this rank's micro-batches (row indices), the global counts, the token cap
        of its micro-batches (``actor.dynamic_token_len``) and this rank's tokens in them."""
        a, dims, hidden_size = self.actor_cfg, self.dims, self.model.config.hidden_size
        seqlens = (batch.prompt_len + batch.response_len).tolist()
        cap = scaled_token_len(a.ppo_max_token_len_per_gpu, float(batch.turns.double().mean()), a.dynamic_token_len,
                               max(seqlens))
        resp = batch.sampled.sum(1).tolist()  # trained-on tokens: multi-turn masks the environment's
        rows_per_mini = a.ppo_mini_batch_size * self.n
        plan = []
        for start in range(0, len(seqlens), rows_per_mini):
            mini = list(range(start, min(start + rows_per_mini, len(seqlens))))
            mine = mini
            if dims.dp > 1:
                part = balanced_dp_split([seqlens[i] for i in mini], dims.dp_group, hidden_size=hidden_size)
                mine = [mini[i] for i in part]
            lens = [seqlens[i] for i in mine]
            if a.use_dynamic_bsz:
                # Per SP group: SP times the per-rank token cap, balanced by attention workload.
                micro = sp_micro_batches(lens, cap, hidden_size=hidden_size, sp=dims.sp)
                if (a.strategy == "fsdp2" and dims.grad_ranks > 1) or dims.ep > 1:
                    # FSDP reduce-scatters in every backward, EP exchanges tokens in every forward:
                    # every rank runs as many.
                    cnt = torch.tensor([len(micro)], device=dims.comm_device)
                    dist.all_reduce(cnt, op=dist.ReduceOp.MAX, group=dims.grad_group)
                    micro = sp_micro_batches(lens, cap, hidden_size=hidden_size, sp=dims.sp,
                                             min_num_micro_batches=int(cnt))
                micro = [[mine[i] for i in mb] for mb in micro]
            else:
                step = a.ppo_micro_batch_size_per_gpu
                micro = [mine[i:i + step] for i in range(0, len(mine), step)]
            plan.append(MiniBatchPlan(micro=micro, num_tokens=sum(resp[i] for i in mini), num_seqs=len(mini),
                                      max_token_len=cap if a.use_dynamic_bsz else None, tokens=sum(lens),
                                      all_tokens=sum(seqlens[i] for i in mini)))
        return plan

    def pack(self, batch: TrainBatch, rows: List[int]) -> MicroBatch:
        return pack_micro_batch(batch, rows, self.device, self.dims.sp_group, self.model.config.num_experts_per_tok,
                                self.actor_cfg.share_prompts)

    @torch.no_grad()
    def log_probs(self, model, plan: List[MiniBatchPlan], packed: List[List[MicroBatch]]) -> List[List[torch.Tensor]]:
        """``model``'s log-probs ``[T]`` of every packed micro-batch (:func:`masked_log_probs`)."""
        return [[masked_log_probs(model, mb, self.temperature) for mb in mbs] for mbs in packed]

    def _with_log_probs(self, model, plan: List[MiniBatchPlan], packed: List[List[MicroBatch]],
                        field: str) -> List[List[MicroBatch]]:
        """``packed`` with ``field`` (``old_log_prob`` / ``ref_log_prob``) set to ``model``'s log-probs
        (router replay R2: the old ones with the routing of their forward)."""
        if field == "old_log_prob" and self.replay:
            return [[self._old_with_routing(mb) for mb in mbs] for mbs in packed]
        lps = self.log_probs(model, plan, packed)
        return [[replace(mb, **{field: lp}) for mb, lp in zip(mbs, row)] for mbs, row in zip(packed, lps)]

    @torch.no_grad()
    def _old_with_routing(self, mb: MicroBatch) -> MicroBatch:
        """``mb`` with the policy's log-probs as ``old_log_prob`` -- R2: and their forward's expert
        choices; R3: routed as the rollout was (``mb.routed_experts``)."""
        if mb.routed_experts is not None:  # R3
            self.model.replay_routing(mb.routed_experts)
            try:
                return replace(mb, old_log_prob=masked_log_probs(self.model, mb, self.temperature))
            finally:
                self.model.replay_routing(None)
        with self.model.trace_routing() as traces:
            lp = masked_log_probs(self.model, mb, self.temperature)
        return replace(mb, old_log_prob=lp, routed_experts=tuple(t.topk_ids for t in traces))

    def _correct(self, batch: TrainBatch, plan: List[MiniBatchPlan], packed: List[List[MicroBatch]]):
        """verl's decoupled rollout correction: ``dk.rollout_correction`` of the old log-probs (``packed``'s)
        vs the rollout's over the whole train batch's ``[N, R]`` grid and its sampled tokens, as verl's driver
        runs it; returns ``(plan, packed, metrics)`` with each micro-batch's IS weights and rejection-masked
        mask, the mini-batches' token counts after rejection (device tensors) and the ``rollout_corr/*``
        metrics (0-dim device tensors). No host read."""
        shape = tuple(batch.log_probs.shape)
        old = self._every_ranks_cells(to_grid(packed, [[mb.old_log_prob for mb in mbs] for mbs in packed], shape,
                                              self.device))
        rc = dk.rollout_correction(old, batch.log_probs.to(self.device), batch.sampled.to(self.device),
                                   **self.correction_options)
        w = rc.rollout_is_weights
        packed = [[replace(mb, mask=from_grid(mb, rc.response_mask),
                           rollout_is_weights=None if w is None else from_grid(mb, w)) for mb in mbs]
                  for mbs in packed]
        if self.correction_options["rollout_rs"] is not None:  # verl's token count is the rejection-masked one
            rows, kept = self.actor_cfg.ppo_mini_batch_size * self.n, rc.response_mask.sum(1)
            plan = [replace(p, num_tokens=kept[k * rows:(k + 1) * rows].sum()) for k, p in enumerate(plan)]
        return plan, packed, rc.metrics

    def _every_ranks_cells(self, grid: torch.Tensor) -> torch.Tensor:
        """``grid`` with the cells the other ranks computed: each cell is one DP rank's row, one SP rank's
        token, on the last pipeline stage (TP ranks hold the same values)."""
        dims = self.dims
        if dims.grad_ranks == 1 and dims.pp == 1:
            return grid
        grid = grid.to(dims.comm_device)
        if dims.pp > 1:
            dist.all_reduce(grid, group=dims.pp_group)
        if dims.grad_ranks > 1:
            dist.all_reduce(grid, group=dims.grad_group)
        return grid.to(self.device)

    def _bypass_correction(self, log_prob: torch.Tensor, mb: MicroBatch):
        """verl's bypass_mode correction of one micro-batch: the current log-probs vs the rollout's (its
        ``old_log_prob``) over its sequences (``dk.rollout_correction``, packed)."""
        return dk.rollout_correction(log_prob, mb.old_log_prob, mb.mask, cu_seqlens=mb.cu_seqlens,
                                     **self.correction_options)

    def update(self, batch: TrainBatch) -> Dict[str, float]:
        """Old / ref log-probs, then the policy update over mini-batches and epochs."""
        a = self.actor_cfg
        t_pack = time.perf_counter()
        if a.mask_truncated_completions:  # overlong filtering: a truncated response trains no token (nor counts)
            batch = replace(batch, sampled=batch.sampled & batch.stopped[:, None])
        plan = self.plan(batch)
        packed = [[self.pack(batch, rows) for rows in p.micro] for p in plan]
        pack_s = time.perf_counter() - t_pack  # planning and packing: counted in update_actor (phases cover the step)
        # One mini-batch, one epoch: the op takes the old log-probs from its own forward (ratio exactly 1);
        # bypass_mode / actor.use_rollout_log_probs: the old log-probs are the rollout's, whatever the plan.
        on_policy = a.ppo_epochs == 1 and len(plan) == 1 and not self.rollout_old
        timing, corrected = {}, {}
        if self.rollout_old:  # verl: no old-log-prob phase at all (so no timing_s/old_log_prob either)
            rollout = batch.log_probs.to(self.device)
            packed = [[replace(mb, old_log_prob=from_grid(mb, rollout)) for mb in mbs] for mbs in packed]
        else:
            t0 = time.perf_counter()
            if not on_policy or self.correct:  # the correction needs the old log-probs on-policy too
                packed = self._with_log_probs(self.model, plan, packed, "old_log_prob")
            if self.correct:
                plan, packed, corrected = self._correct(batch, plan, packed)
            timing["timing_s/old_log_prob"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        if self.ref_model is not None:
            packed = self._with_log_probs(self.ref_model, plan, packed, "ref_log_prob")
            timing["timing_s/ref"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        # Metric sums stay on the device through the micro-batch loop (no host read there); the loss and
        # the gradient norm are read once per update, to decide whether to apply it.
        names = _SUMS + ((*self.bypass_metrics, _CORRECTED) if self.bypass else ())
        sums = {name: torch.zeros((), dtype=torch.float64, device=self.device) for name in names}
        cfg, sparse = self.model.config, len(self.model.sparse_blocks())
        self.router_load = RouterLoad(sparse, cfg.num_experts, cfg.num_experts_per_tok, self.device) \
            if sparse and self.dims.pp == 1 else None  # PipelinedActor traces nothing
        loss_sum = norm_sum = 0.0
        n_updates, skipped, has_kl = 0, [], False
        for epoch in range(a.ppo_epochs):
            for i, (p, mbs) in enumerate(zip(plan, packed)):
                self.optimizer.zero_grad(set_to_none=True)
                mini_loss, kl = self._backward_mini_batch(p, mbs, on_policy, sums)
                if self.dims.tp > 1:  # per-head q/k norms (Qwen3, Gemma 3): their partial gradients summed
                    tp_grad_sync(self.model)
                has_kl = has_kl or kl
                self._poison_grads_unless_finite(mini_loss)
                loss_val, norm = torch.stack([mini_loss, self.clip_grads().double()]).tolist()
                loss_sum, norm_sum = loss_sum + loss_val, norm_sum + norm
                if math.isfinite(norm) and math.isfinite(loss_val):
                    self.optimizer.step()
                    n_updates += 1
                else:  # not applied: the weights and Adam's moments stay as they were
                    what = f"loss {loss_val}" if not math.isfinite(loss_val) else f"gradient norm {norm}"
                    skipped.append(f"epoch {epoch + 1} mini-batch {i + 1}: non-finite {what}")
        if n_updates:  # a step with no applied update does not advance the LR schedule
            self.scheduler.step()
        timing["timing_s/update_actor"] = time.perf_counter() - t0 + pack_s
        totals, loss_sum = self._reduce_sums(sums, loss_sum)

        n_mini = a.ppo_epochs * len(plan)
        out = {"actor/loss": loss_sum / n_mini, "actor/pg_loss": totals["actor/pg_loss"] / n_mini,
               "actor/grad_norm": norm_sum / n_mini, "actor/lr": self.optimizer.param_groups[0]["lr"],
               "actor/num_updates": n_updates, "actor/skipped_updates": len(skipped)}
        if skipped:
            out["actor/skip_reason"] = "; ".join(skipped)
        out.update({name: totals[name] / max(totals["tokens"], 1.0) for name in _TOKEN_MEANS})
        if has_kl:
            out["actor/kl_loss"] = totals["actor/kl_loss"] / n_mini
        if self.bypass:
            out.update({name: totals[name] / max(totals[_CORRECTED], 1.0) for name in self.bypass_metrics})
        if self.router_load is not None:
            out.update(self.router_load.metrics(self.dims.grad_group if self.dims.grad_ranks > 1 else None,
                                                self.dims.comm_device))
        if corrected:  # the step's one read of them, with its other metrics
            out.update(zip(corrected, torch.stack(list(corrected.values())).tolist()))
        out.update(timing)
        if a.use_dynamic_bsz:  # the micro-batch token cap and how full it keeps this rank's micro-batches
            n_micro, cap = sum(len(p.micro) for p in plan), plan[0].max_token_len
            out.update({"actor/max_token_len": float(cap), "actor/num_micro_batches": float(n_micro),
                        "actor/micro_batch_utilization": sum(p.tokens for p in plan) / (n_micro * cap)})
        return out

    def _micro_loss(self, hidden: torch.Tensor, mb: MicroBatch, p: MiniBatchPlan, on_policy: bool,
                    sums: Dict[str, torch.Tensor], mini_loss: torch.Tensor) -> Tuple[torch.Tensor, bool]:
        """The loss of one micro-batch to backpropagate, and whether it had a KL term; adds its loss to
        ``mini_loss`` (the mini-batch's so far, in place) and its metrics to ``sums``."""
        seq_mode = self.actor_cfg.loss_agg_mode.startswith("seq")
        mask, corrected = mb.mask, None
        if self.bypass and self.correction_options["rollout_rs"] is not None:
            # verl's bypass_mode rejects tokens by the current policy vs the rollout, before the loss.
            with torch.no_grad():
                corrected = self._bypass_correction(project_log_probs(self.model, hidden, mb, self.temperature), mb)
            mask = corrected.response_mask
        # Read after the forward: FSDP2 swaps the root's gathered weights in there
        # (before it, lm_head.weight is this rank's DTensor shard). bypass_mode's PPO-clip takes no IS weights
        # (the ratio to the rollout policy is the correction, as verl's).
        loss, m = dk.fused_linear_policy_loss(
            hidden, self.model.lm_head.weight, mb.labels, None if on_policy else mb.old_log_prob, mb.advantages,
            mask, num_tokens=p.num_tokens, num_seqs=p.num_seqs, cu_seqlens=mb.cu_seqlens if seq_mode else None,
            ref_log_prob=mb.ref_log_prob, rollout_is_weights=mb.rollout_is_weights, **self.loss_options)
        mini_loss += loss.detach().double()
        add_loss_metrics(sums, m, mask)
        if self.bypass:  # verl's bypass_mode metrics of this micro-batch (the current policy vs the rollout)
            if corrected is None:
                corrected = self._bypass_correction(m["log_prob"], mb)
            for name, v in corrected.metrics.items():
                sums[name] += v
            sums[_CORRECTED] += 1
        # A rank whose loss so far is not finite backpropagates NaN: DDP's reduction (in the last
        # micro-batch's backward), FSDP's reduce-scatter or the norm's all-reduce then hands every
        # rank a non-finite norm, and all of them skip the update together. DDP and FSDP average
        # gradients; the loss is a global sum.
        scale = torch.where(torch.isfinite(mini_loss), float(self.dims.grad_ranks), float("nan")).to(loss.dtype)
        return loss * scale, "kl_loss" in m

    def _backward_mini_batch(self, p: MiniBatchPlan, mbs: List[MicroBatch], on_policy: bool,
                             sums: Dict[str, torch.Tensor]):
        """Forward, loss and backward of one mini-batch's micro-batches, adding their metrics to
        ``sums``; returns ``(its loss, a 0-dim device tensor; whether the loss had a KL term)``."""
        forward = self.ddp or self.model
        mini_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        has_kl = False
        for j, mb in enumerate(mbs):
            # DDP all-reduces in the last micro-batch's backward only; the others accumulate.
            sync = self.ddp.no_sync() if self.ddp is not None and j + 1 < len(mbs) else nullcontext()
            with sync:
                if mb.routed_experts is not None:  # R2; kept through the backward (checkpointing recomputes)
                    self.model.replay_routing(mb.routed_experts)
                try:
                    with self.model.trace_routing() as traces:  # the forward's only: not the recompute
                        hidden = forward(mb.input_ids, mb.cu_seqlens, mb.max_seqlen, sharing=mb.sharing)
                    loss, kl = self._micro_loss(hidden, mb, p, on_policy, sums, mini_loss)
                    if self.router_load is not None:
                        loss = loss + self._router_aux_loss(traces, p)
                    loss.backward()
                finally:
                    if mb.routed_experts is not None:
                        self.model.replay_routing(None)
                has_kl = has_kl or kl
        return mini_loss, has_kl

    def _router_aux_loss(self, traces, p: MiniBatchPlan) -> torch.Tensor:
        """The micro-batch's router aux-loss term (module doc; counts its routing in ``self.router_load``):
        ``coef * aux * T / (the mini-batch's tokens over every rank)``, times the gradient ranks, which
        average it: the mini-batch adds the token-weighted mean of its micro-batches' (SP: shards') losses."""
        aux = self.router_load.add(traces)
        if not self.aux_coef:
            return aux.new_zeros(())
        T = traces[0].logits.shape[0]
        return aux * (self.aux_coef * T * self.dims.grad_ranks / p.all_tokens)

    def _reduce_sums(self, sums: Dict[str, torch.Tensor], loss_sum: float):
        """``sums`` on the host (one read), summed over the gradient ranks with ``loss_sum``; the
        gradient norm is identical on every rank, so only the per-rank sums are summed."""
        names = list(sums)
        vec = torch.stack([sums[k] for k in names])
        if self.dims.grad_ranks > 1:
            vec = torch.cat([vec, torch.tensor([loss_sum], dtype=torch.float64, device=vec.device)])
            vec = vec.to(self.dims.comm_device)
            dist.all_reduce(vec, group=self.dims.grad_group)
            *values, loss_sum = vec.tolist()
        else:
            values = vec.tolist()
        return dict(zip(names, values)), loss_sum

    def _poison_grads_unless_finite(self, loss: torch.Tensor) -> None:
        """Add NaN to this rank's gradients when ``loss`` is not finite, else 0 (no host read)."""
        poison = torch.where(torch.isfinite(loss), 0.0, float("nan")).float()
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.add_(poison)  # a 0-dim tensor operand: a foreach op would read it on the CPU

    def clip_grads(self, pp_group=None, exclude: Optional[torch.nn.Parameter] = None) -> torch.Tensor:
        """Clip to ``actor.grad_clip`` by the norm of the full (unsharded) gradient; return the norm
        (a 0-dim tensor on the device: nothing is read here)."""
        dims = self.dims
        tp = dims.tp > 1
        return clip_grad_norm(self.model, self.actor_cfg.grad_clip, tp_group=dims.tp_group if tp else None,
                              sharded=tp_shard_dims(self.model) if tp else (), dp_group=dims.dp_group,
                              pp_group=pp_group, exclude=exclude, comm_device=dims.comm_device,
                              ep_group=dims.ep_group, ep_sharded=expert_shard_names(self.model))


class PipelinedActor(Actor):
    """The policy update under pipeline parallelism (``actor.pipeline_model_parallel_size > 1``).

    The model is this rank's stages (:func:`~dapo_trainer.parallel.apply_pipeline`); each
    mini-batch's micro-batches (at least one per pipeline rank; under interleaving a count torch's
    schedule takes) run in ``dk.pipeline_order`` through the schedule, every one padded to the
    mini-batch's token cap. The loss, the log-probs and the metrics are computed on the last
    stage; its loss and metric sums go to every pipeline rank (the skip decision is common).
    """

    def __init__(self, cfg, dims: ParallelDims, model, ref_model=None, *, device: torch.device):
        from .parallel import build_pipeline

        super().__init__(cfg, dims, model, ref_model, device=device)
        a = self.actor_cfg
        rows = a.ppo_mini_batch_size * self.n  # the most sequences a micro-batch can hold
        ddp = dims.grad_ranks > 1 and a.strategy == "ddp"
        self.pipe = build_pipeline(model, dims, ddp=ddp, max_seqs=rows)
        self.ref_pipe = build_pipeline(ref_model, dims, ddp=False, max_seqs=rows) if ref_model is not None else None
        self.longest = cfg.data.max_prompt_length + cfg.data.max_response_length

    def _count_ok(self, m: int) -> bool:
        pp = self.dims.pp  # ScheduleInterleaved1F1B runs rounds of equal size: m % (m // pp) == 0
        return m >= pp and (self.dims.vpp == 1 or m % max(1, m // pp) == 0)

    def plan(self, batch: TrainBatch) -> List[MiniBatchPlan]:
        a, hidden_size = self.actor_cfg, self.model.config.hidden_size
        seqlens = (batch.prompt_len + batch.response_len).tolist()
        work = dk.attention_workload(seqlens, hidden_size)
        plan = []
        for p in super().plan(batch):
            micro = p.micro
            rows = [i for mb in micro for i in mb]
            need = len(micro)
            for _ in range(8):  # micro_batches may split into more than asked: settle on a count the schedule takes
                if self._count_ok(len(micro)):
                    break
                while not self._count_ok(need):
                    need += 1
                if a.use_dynamic_bsz:
                    split = sp_micro_batches([seqlens[i] for i in rows], p.max_token_len, hidden_size=hidden_size,
                                             min_num_micro_batches=min(need, len(rows)))
                    micro = [[rows[i] for i in mb] for mb in split]
                else:
                    micro = [rows[len(rows) * k // need:len(rows) * (k + 1) // need] for k in range(need)]
                micro += [[] for _ in range(need - len(micro))]  # fewer rows than micro-batches: empty ones
                need = max(need, len(micro))
            order = dk.pipeline_order(micro, work)
            # The static token count of the pipe: the cap (fixed-size micro-batches: their longest possible pack).
            plan.append(replace(p, micro=[micro[i] for i in order],
                                shape=p.max_token_len or a.ppo_micro_batch_size_per_gpu * self.longest))
        return plan

    def pack(self, batch: TrainBatch, rows: List[int]) -> MicroBatch:
        return super().pack(batch, rows) if rows else MicroBatch.empty(self.device)

    @torch.no_grad()
    def log_probs(self, model, plan: List[MiniBatchPlan], packed: List[List[MicroBatch]]) -> List[List[torch.Tensor]]:
        """Computed on the last stage (None elsewhere, and for an empty micro-batch)."""
        pipe = self.pipe if model is self.model else self.ref_pipe
        out = [[None] * len(mbs) for mbs in packed]
        for p, mbs, lps in zip(plan, packed, out):
            def on_output(i, hidden, mbs=mbs, lps=lps):
                if hidden.shape[0]:
                    lps[i] = project_log_probs(model, hidden, mbs[i], self.temperature)
                return hidden.sum()

            pipe.run(mbs, p.shape, on_output, train=False)
        return out

    def _backward_mini_batch(self, p: MiniBatchPlan, mbs: List[MicroBatch], on_policy: bool,
                             sums: Dict[str, torch.Tensor]):
        from .parallel import tied_grad_sync

        # The mini-batch's loss and whether it had a KL term: known on the last stage, then on every pipeline rank.
        mini_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        has_kl = False

        def on_output(i, hidden):
            nonlocal has_kl
            if not hidden.shape[0]:
                return hidden.sum()  # an empty micro-batch: a zero loss (its backward still runs)
            loss, has_kl = self._micro_loss(hidden, mbs[i], p, on_policy, sums, mini_loss)
            return loss

        self.pipe.run(mbs, p.shape, on_output, train=True)
        tied_grad_sync(self.model, self.dims.tied_group)
        vec = torch.stack([mini_loss, mini_loss.new_tensor(float(has_kl))]).to(self.dims.comm_device)
        dist.all_reduce(vec, group=self.dims.pp_group)
        mini_loss, kl = vec.to(self.device).unbind()
        return mini_loss, bool(kl)

    def _reduce_sums(self, sums: Dict[str, torch.Tensor], loss_sum: float):
        names = list(sums)  # the last stage's sums to every pipeline rank, then over the gradient ranks
        vec = torch.stack([sums[k] for k in names]).to(self.dims.comm_device)
        dist.all_reduce(vec, group=self.dims.pp_group)
        return super()._reduce_sums(dict(zip(names, vec.to(self.device).unbind())), loss_sum)

    def clip_grads(self, pp_group=None, exclude=None) -> torch.Tensor:
        from .parallel import tied_parameter

        # The last stage's copy of a tied embedding is clipped but left out of the norm (the first stage's counts it).
        copy = tied_parameter(self.model) if self.model.embed_tokens is None else None
        return super().clip_grads(pp_group=self.dims.pp_group, exclude=copy)
