"""The actor update of a DAPO step: plan, pack, log-probs, loss, clip, optimizer step.

Per mini-batch: sequences balanced over data-parallel ranks (``dk.balanced_partitions``),
token-capped micro-batches (``dk.micro_batches``, balanced by attention workload; the cap is per
rank, so an SP group's micro-batch holds SP times as many tokens) packed through the model,
``dk.fused_linear_policy_loss`` normalised by the mini-batch's global token count, gradients
averaged over the gradient ranks by torch's DDP (once per mini-batch: the micro-batches before
the last accumulate under ``no_sync``) or FSDP2, clipping, AdamW with warmup. An update whose
loss or gradient norm is not finite is skipped.
"""
from __future__ import annotations

import math
import time
from contextlib import nullcontext
from typing import Dict, List

import torch
import torch.distributed as dist

import dapo_kernels as dk
from dapo_kernels.validation import to_device_checked

from .parallel import ParallelDims, apply_ddp, balanced_dp_split, shard_sequence, sp_micro_batches, tp_shard_dims

# The loss's per-token fractions (its name: the metric's), summed times tokens over the update.
_LOSS_FRACTIONS = {"pg_clipfrac": "actor/pg_clipfrac", "pg_clipfrac_lower": "actor/pg_clipfrac_lower",
                   "ppo_kl": "actor/ppo_kl"}
# Metrics averaged over the update's response tokens.
_TOKEN_MEANS = (*_LOSS_FRACTIONS.values(), "actor/entropy")
# The update's metric sums kept on the device: per mini-batch means, token-weighted sums, and the token count.
_SUMS = ("actor/pg_loss", "actor/kl_loss") + _TOKEN_MEANS + ("tokens",)


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


def pack_micro_batch(batch, rows: List[int], device: torch.device, sp_group=None) -> dict:
    """Prompt + response of ``rows`` end to end, labels shifted by one token; under sequence
    parallelism (``sp_group``) the labels, mask and advantages are this rank's token shard."""
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
    lens = [cu[j + 1] - cu[j] for j in range(len(rows))]
    mask, adv = torch.cat(mask), torch.cat(adv)
    if sp_group is not None:  # the model takes every token and computes this rank's shard; the loss reads that shard
        labels, mask, adv = (shard_sequence(t, sp_group) for t in (labels, mask, adv))
    # ids, labels and cu_seqlens are checked here, on the host, so that the model and the loss
    # read nothing of them inside the micro-batch loop; the masked positions are listed here too
    # (a host tensor: no device read), for masked_log_probs.
    return {"input_ids": to_device_checked(input_ids, device), "labels": to_device_checked(labels, device),
            "mask": mask.to(device), "mask_index": mask.nonzero().squeeze(1).to(device), "advantages": adv.to(device),
            "cu_seqlens": to_device_checked(torch.tensor(cu, dtype=torch.int32), device), "max_seqlen": max(lens)}


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

    def plan(self, batch) -> List[dict]:
        """Per mini-batch: this rank's micro-batches (row indices), the global counts, the token cap
        of its micro-batches (``actor.dynamic_token_len``) and this rank's tokens in them."""
        a, dims, hidden_size = self.actor_cfg, self.dims, self.model.config.hidden_size
        seqlens = (batch["prompt_len"] + batch["response_len"]).tolist()
        turns = batch["num_turns"] if "num_turns" in batch else torch.ones(len(seqlens))
        cap = scaled_token_len(a.ppo_max_token_len_per_gpu, float(turns.double().mean()), a.dynamic_token_len,
                               max(seqlens))
        resp = batch["response_mask"].sum(1).tolist()  # trained-on tokens: multi-turn masks the environment's
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
                if a.strategy == "fsdp2" and dims.grad_ranks > 1:
                    # FSDP reduce-scatters in every backward: every rank runs as many.
                    cnt = torch.tensor([len(micro)], device=dims.comm_device)
                    dist.all_reduce(cnt, op=dist.ReduceOp.MAX, group=dims.grad_group)
                    micro = sp_micro_batches(lens, cap, hidden_size=hidden_size, sp=dims.sp,
                                             min_num_micro_batches=int(cnt))
                micro = [[mine[i] for i in mb] for mb in micro]
            else:
                step = a.ppo_micro_batch_size_per_gpu
                micro = [mine[i:i + step] for i in range(0, len(mine), step)]
            plan.append({"micro": micro, "num_tokens": sum(resp[i] for i in mini), "num_seqs": len(mini),
                         "max_token_len": cap if a.use_dynamic_bsz else None, "tokens": sum(lens)})
        return plan

    def pack(self, batch, rows: List[int]) -> dict:
        return pack_micro_batch(batch, rows, self.device, self.dims.sp_group)

    @torch.no_grad()
    def log_probs(self, model, mb: dict) -> torch.Tensor:
        """Old / reference log-probs ``[T]`` of a packed micro-batch (:func:`masked_log_probs`)."""
        return masked_log_probs(model, mb, self.temperature)

    def _fill_log_probs(self, model, plan: List[dict], packed: List[List[dict]], key: str) -> None:
        """``mb[key]``: ``model``'s log-probs of every packed micro-batch."""
        for mb in (mb for mbs in packed for mb in mbs):
            mb[key] = self.log_probs(model, mb)

    def update(self, batch) -> Dict[str, float]:
        """Old / ref log-probs, then the policy update over mini-batches and epochs."""
        a = self.actor_cfg
        plan = self.plan(batch)
        packed = [[self.pack(batch, rows) for rows in p["micro"]] for p in plan]
        # One mini-batch, one epoch: the op takes the old log-probs from its own forward (ratio exactly 1).
        on_policy = a.ppo_epochs == 1 and len(plan) == 1
        timing = {}
        t0 = time.perf_counter()
        if not on_policy:
            self._fill_log_probs(self.model, plan, packed, "old_log_prob")
        timing["timing_s/old_log_prob"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        if self.ref_model is not None:
            self._fill_log_probs(self.ref_model, plan, packed, "ref_log_prob")
            timing["timing_s/ref"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        # Metric sums stay on the device through the micro-batch loop (no host read there); the loss and
        # the gradient norm are read once per update, to decide whether to apply it.
        sums = {name: torch.zeros((), dtype=torch.float64, device=self.device) for name in _SUMS}
        loss_sum = norm_sum = 0.0
        n_updates, skipped, has_kl = 0, [], False
        for epoch in range(a.ppo_epochs):
            for i, (p, mbs) in enumerate(zip(plan, packed)):
                self.optimizer.zero_grad(set_to_none=True)
                mini_loss, kl = self._backward_mini_batch(p, mbs, on_policy, sums)
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
        timing["timing_s/update_actor"] = time.perf_counter() - t0
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
        out.update(timing)
        if a.use_dynamic_bsz:  # the micro-batch token cap and how full it keeps this rank's micro-batches
            n_micro, cap = sum(len(p["micro"]) for p in plan), plan[0]["max_token_len"]
            out.update({"actor/max_token_len": float(cap), "actor/num_micro_batches": float(n_micro),
                        "actor/micro_batch_utilization": sum(p["tokens"] for p in plan) / (n_micro * cap)})
        return out

    def _backward_mini_batch(self, p: dict, mbs: List[dict], on_policy: bool, sums: Dict[str, torch.Tensor]):
        """Forward, loss and backward of one mini-batch's micro-batches, adding their metrics to
        ``sums``; returns ``(its loss, a 0-dim device tensor; whether the loss had a KL term)``."""
        seq_mode = self.actor_cfg.loss_agg_mode.startswith("seq")
        dp_scale = float(self.dims.grad_ranks)  # DDP and FSDP average gradients; the loss is a global sum
        forward = self.ddp or self.model
        mini_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        has_kl = False
        for j, mb in enumerate(mbs):
            # DDP all-reduces in the last micro-batch's backward only; the others accumulate.
            sync = self.ddp.no_sync() if self.ddp is not None and j + 1 < len(mbs) else nullcontext()
            with sync:
                hidden = forward(mb["input_ids"], mb["cu_seqlens"], mb["max_seqlen"])
                # Read after the forward: FSDP2 swaps the root's gathered weights in there
                # (before it, lm_head.weight is this rank's DTensor shard).
                weight = self.model.lm_head.weight
                loss, m = dk.fused_linear_policy_loss(
                    hidden, weight, mb["labels"], None if on_policy else mb["old_log_prob"], mb["advantages"],
                    mb["mask"], num_tokens=p["num_tokens"], num_seqs=p["num_seqs"],
                    cu_seqlens=mb["cu_seqlens"] if seq_mode else None, ref_log_prob=mb.get("ref_log_prob"),
                    **self.loss_options)
                mini_loss += loss.detach().double()
                # A rank whose loss so far is not finite backpropagates NaN: DDP's reduction (in the last
                # micro-batch's backward), FSDP's reduce-scatter or the norm's all-reduce then hands every
                # rank a non-finite norm, and all of them skip the update together.
                scale = torch.where(torch.isfinite(mini_loss), dp_scale, float("nan")).to(loss.dtype)
                (loss * scale).backward()
                has_kl = has_kl or "kl_loss" in m
                add_loss_metrics(sums, m, mb["mask"])
        return mini_loss, has_kl

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

    def clip_grads(self) -> torch.Tensor:
        """Clip to ``actor.grad_clip`` by the norm of the full (unsharded) gradient; return the norm
        (a 0-dim tensor on the device: nothing is read here)."""
        from torch.distributed.tensor import DTensor

        clip, dims = self.actor_cfg.grad_clip, self.dims
        if dims.tp == 1:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
            # FSDP2: the norm of DTensor gradients is a (replicated) DTensor; read as a plain tensor.
            return norm.full_tensor() if isinstance(norm, DTensor) else norm

        # Squared norms of this rank's gradients: [0] of the parameters sharded over the TP group,
        # [1] of those replicated over it. Under FSDP2 the gradients are DTensors sharded over the DP
        # ranks too: their local shards are summed over the DP group first.
        sharded = tp_shard_dims(self.model)
        sq = torch.zeros(2, dtype=torch.float64, device=dims.comm_device)
        grads, fsdp = [], False
        for name, p in self.model.named_parameters():
            if p.grad is not None:
                g = p.grad
                if isinstance(g, DTensor):
                    g, fsdp = g.to_local(), True
                sq[0 if name in sharded else 1] += g.double().pow(2).sum()
                grads.append(g)
        if fsdp:
            dist.all_reduce(sq, group=dims.dp_group)
        shard_sq = sq[:1].clone()
        dist.all_reduce(shard_sq, group=dims.tp_group)
        norm = (shard_sq[0] + sq[1]).sqrt()
        coef = (clip / (norm + 1e-6)).clamp(max=1.0).float()  # as clip_grad_norm_, on the device
        for g in grads:  # local shards: scaling them scales the DTensors
            g.mul_(coef)
        return norm


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

    def plan(self, batch) -> List[dict]:
        a, hidden_size = self.actor_cfg, self.model.config.hidden_size
        seqlens = (batch["prompt_len"] + batch["response_len"]).tolist()
        work = dk.attention_workload(seqlens, hidden_size)
        plan = super().plan(batch)
        for p in plan:
            micro = p["micro"]
            rows = [i for mb in micro for i in mb]
            need = len(micro)
            for _ in range(8):  # micro_batches may split into more than asked: settle on a count the schedule takes
                if self._count_ok(len(micro)):
                    break
                while not self._count_ok(need):
                    need += 1
                if a.use_dynamic_bsz:
                    split = sp_micro_batches([seqlens[i] for i in rows], p["max_token_len"], hidden_size=hidden_size,
                                             min_num_micro_batches=min(need, len(rows)))
                    micro = [[rows[i] for i in mb] for mb in split]
                else:
                    micro = [rows[len(rows) * k // need:len(rows) * (k + 1) // need] for k in range(need)]
                micro += [[] for _ in range(need - len(micro))]  # fewer rows than micro-batches: empty ones
                need = max(need, len(micro))
            order = dk.pipeline_order(micro, work)
            p["micro"] = [micro[i] for i in order]
            # The static token count of the pipe: the cap (fixed-size micro-batches: their longest possible pack).
            p["shape"] = p["max_token_len"] or a.ppo_micro_batch_size_per_gpu * self.longest
        return plan

    def pack(self, batch, rows: List[int]) -> dict:
        if rows:
            return super().pack(batch, rows)
        d = self.device  # an empty micro-batch: all padding in the pipe, no loss
        return {"input_ids": torch.zeros(0, dtype=torch.long, device=d), "cu_seqlens": torch.zeros(1, dtype=torch.int32,
                device=d), "max_seqlen": 0}

    def _fill_log_probs(self, model, plan: List[dict], packed: List[List[dict]], key: str) -> None:
        pipe = self.pipe if model is self.model else self.ref_pipe

        def on_output(i, hidden):
            mb = mbs[i]
            if hidden.shape[0]:
                idx = mb["mask_index"]
                lp, _ = model.log_probs(hidden.index_select(0, idx), mb["labels"].index_select(0, idx),
                                        temperature=self.temperature)
                mb[key] = lp.new_zeros(hidden.shape[0]).index_copy_(0, idx, lp)
            return hidden.sum()

        with torch.no_grad():
            for p, mbs in zip(plan, packed):
                pipe.run(mbs, p["shape"], on_output, train=False)

    def _backward_mini_batch(self, p: dict, mbs: List[dict], on_policy: bool, sums: Dict[str, torch.Tensor]):
        from .parallel import tied_grad_sync

        seq_mode = self.actor_cfg.loss_agg_mode.startswith("seq")
        dp_scale = float(self.dims.grad_ranks)
        # [the mini-batch's loss, whether it had a KL term]: known on the last stage, then on every pipeline rank
        out = torch.zeros(2, dtype=torch.float64, device=self.device)

        def on_output(i, hidden):
            mb = mbs[i]
            if not hidden.shape[0]:
                return hidden.sum()  # an empty micro-batch: a zero loss (its backward still runs)
            loss, m = dk.fused_linear_policy_loss(
                hidden, self.model.lm_head.weight, mb["labels"], None if on_policy else mb["old_log_prob"],
                mb["advantages"], mb["mask"], num_tokens=p["num_tokens"], num_seqs=p["num_seqs"],
                cu_seqlens=mb["cu_seqlens"] if seq_mode else None, ref_log_prob=mb.get("ref_log_prob"),
                **self.loss_options)
            out[0] += loss.detach().double()
            out[1] = float("kl_loss" in m)
            add_loss_metrics(sums, m, mb["mask"])
            # As without PP: a non-finite loss so far backpropagates NaN, and every rank skips the update.
            return loss * torch.where(torch.isfinite(out[0]), dp_scale, float("nan")).to(loss.dtype)

        self.pipe.run(mbs, p["shape"], on_output, train=True)
        tied_grad_sync(self.model, self.dims.tied_group)
        vec = out.to(self.dims.comm_device)
        dist.all_reduce(vec, group=self.dims.pp_group)
        mini_loss, has_kl = vec.to(self.device).unbind()
        return mini_loss, bool(has_kl)

    def _reduce_sums(self, sums: Dict[str, torch.Tensor], loss_sum: float):
        names = list(sums)  # the last stage's sums to every pipeline rank, then over the gradient ranks
        vec = torch.stack([sums[k] for k in names]).to(self.dims.comm_device)
        dist.all_reduce(vec, group=self.dims.pp_group)
        return super()._reduce_sums(dict(zip(names, vec.to(self.device).unbind())), loss_sum)

    def clip_grads(self) -> torch.Tensor:
        from .parallel import pp_clip_grads

        dims, fsdp = self.dims, self.actor_cfg.strategy == "fsdp2" and self.dims.grad_ranks > 1
        return pp_clip_grads(self.model, self.actor_cfg.grad_clip, pp_group=dims.pp_group,
                             tp_group=dims.tp_group if dims.tp > 1 else None, dp_group=dims.dp_group,
                             sharded=tp_shard_dims(self.model) if dims.tp > 1 else (), fsdp=fsdp,
                             comm_device=dims.comm_device)
