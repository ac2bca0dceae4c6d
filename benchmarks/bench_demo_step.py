"""The demo's training step on the CPU: our old log-probs and updates vs transformers' Llama.

``PYTHONPATH=. python benchmarks/bench_demo_step.py [--repeats 5] [--batches 3] [--profile VARIANT]``

What ``make demo`` trains on: its warm-started model (built or found in ``.cache/dapo_demo``, as the
demo does) and real train batches of its config (``configs/demo.yaml``: 16 prompts x 8 samples, 4
mini-batches of 32 sequences, one micro-batch each), generated once by the trainer's own generation
stage. Per train batch, each variant runs the two phases of a step that follow generation:

* ``old``: the log-probs of every response token under the current weights (no grad), per
  mini-batch;
* ``update``: per mini-batch, forward, the DAPO loss (token-mean, clip 0.2 / 0.28, entropy for the
  metric), backward, gradient clipping and the AdamW step.

Variants:

* ``ours``: the trainer's ``Actor.update`` (its ``timing_s/old_log_prob`` and
  ``timing_s/update_actor``: what the demo's metrics log; the total adds its planning and packing),
  with the demo's ``actor.share_prompts=true`` (a group's prompt computed once);
* ``ours_apart``: the same with ``share_prompts=false`` (every sequence packed whole);
* ``hf_packed``: transformers' ``LlamaForCausalLM`` (sdpa attention) loaded from the same model
  directory, the same packed tokens as one ``[1, T]`` row with per-sequence ``position_ids`` and a
  block-diagonal causal ``[1, 1, T, T]`` mask (its sdpa path attends across sequences without one);
* ``hf_padded``: the same model on the mini-batch right-padded to ``[32, S]`` with an attention
  mask, as TRL's ``GRPOTrainer`` batches it (prompt and completion in one row).

The ``hf_*`` old-log-prob phase includes building their inputs; ``total`` is old + update (+ ours' plan and
pack), the column the ratio compares.

1 thread (``torch.set_num_threads(1)``, as the demo). The variants alternate within each repeat (load
from other processes hits them alike) and the order rotates per repeat; the table shows per train
batch the median and the min-max over repeats. ``--profile`` prints a torch.profiler table of one
variant's phases instead.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import fields
from types import SimpleNamespace

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

CLIP_LOW, CLIP_HIGH = 0.2, 0.28
# The phases' clock: wall time, or this thread's CPU time (--clock cpu: what another process's load on a
# shared machine inflates least; with 1 thread, torch computes on the calling thread).
CLOCK = time.perf_counter


def demo_setup(num_batches: int, cache_dir: str = ".cache/dapo_demo"):
    """(trainer config, model dir, [TrainBatch]) of the demo, the batches from its generation stage."""
    from dapo_trainer.config import load_config
    from dapo_trainer.demo import DEFAULT_CONFIG
    from dapo_trainer.demo.assets import DemoConfig, build_demo
    from dapo_trainer.records import TrainBatch
    from dapo_trainer.trainer import DAPOTrainer

    assets = build_demo(DemoConfig(seed=0), cache_dir=cache_dir, progress=False)
    cfg = load_config(DEFAULT_CONFIG, [
        f"actor_rollout_ref.model.path={assets.model_dir}", f"data.train_files=[{assets.train_file}]",
        f"data.val_files=[{assets.val_file}]", f"trainer.default_local_dir={tempfile.mkdtemp()}",
        "trainer.seed=0", "trainer.logger=[console]"])
    cache = os.path.join(assets.root, f"bench_batches_{num_batches}.pt")
    if os.path.isfile(cache):
        return cfg, assets.model_dir, [TrainBatch(**b) for b in torch.load(cache)]
    trainer = DAPOTrainer(cfg)
    batches = [trainer.generation.collect(step)[0] for step in range(1, num_batches + 1)]
    torch.save([{f.name: getattr(b, f.name) for f in fields(b)} for b in batches], cache)
    return cfg, assets.model_dir, batches


class Ours:
    """The trainer's actor on the demo model; its phase timings read ``CLOCK`` (the actor's own timers)."""

    def __init__(self, cfg, model_dir, share_prompts: bool = True):
        import copy

        import dapo_trainer.actor as actor_module
        from dapo_trainer.hf_io import load_hf_model
        from dapo_trainer.parallel import ParallelDims

        dev = torch.device("cpu")
        cfg = copy.deepcopy(cfg)
        cfg.actor_rollout_ref.actor.share_prompts = share_prompts
        self.model = load_hf_model(model_dir)
        dims = ParallelDims.build(cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout.n, dev)
        self.actor = actor_module.Actor(cfg, dims, self.model, device=dev)
        # The actor times its phases with time.perf_counter: the same timers, on the chosen clock.
        actor_module.time = SimpleNamespace(perf_counter=lambda: CLOCK())

    def step(self, batch):
        t0 = CLOCK()
        m = self.actor.update(batch)  # plan and pack (outside its phase timers) included in the total
        return m["timing_s/old_log_prob"], m["timing_s/update_actor"], CLOCK() - t0


class HF:
    """transformers' Llama on the same model directory and rows; ``packed``: one ``[1, T]`` row."""

    def __init__(self, cfg, model_dir, packed: bool):
        from transformers import LlamaForCausalLM

        self.model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
        self.model.train()
        a = cfg.actor_rollout_ref.actor
        self.rows_per_mini = a.ppo_mini_batch_size * cfg.actor_rollout_ref.rollout.n
        self.grad_clip = a.grad_clip
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=a.optim.lr, weight_decay=0.0)
        self.packed = packed

    def _inputs(self, batch, rows):
        """Model kwargs, labels and the response-token mask, in the model's layout."""
        seqs, masks, advs = [], [], []
        for i in rows:
            pl, rl = int(batch.prompt_len[i]), int(batch.response_len[i])
            seqs.append(torch.cat([batch.prompt_ids[i, :pl], batch.response_ids[i, :rl]]))
            m = torch.zeros(pl + rl, dtype=torch.bool)
            m[pl - 1:pl + rl - 1] = batch.sampled[i, :rl]  # position t predicts token t + 1
            masks.append(m)
            advs.append(float(batch.advantages[i]))
        if self.packed:
            ids = torch.cat(seqs)[None]
            pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
            labels = torch.cat([torch.cat([s[1:], s.new_zeros(1)]) for s in seqs])[None]
            mask = torch.cat(masks)[None]
            adv = torch.cat([torch.full((len(s),), a) for s, a in zip(seqs, advs)])[None]
            # Block-diagonal causal mask: transformers' sdpa path does not infer one from position_ids.
            seq = torch.cat([torch.full((len(s),), k) for k, s in enumerate(seqs)])
            causal = torch.ones(len(seq), len(seq), dtype=torch.bool).tril_()
            attn = ((seq[:, None] == seq[None, :]) & causal)[None, None]
            return dict(input_ids=ids, position_ids=pos, attention_mask=attn), labels, mask, adv
        S = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), S, dtype=torch.long)
        attn = torch.zeros(len(seqs), S, dtype=torch.long)
        mask = torch.zeros(len(seqs), S, dtype=torch.bool)
        labels = torch.zeros(len(seqs), S, dtype=torch.long)
        for r, (s, m) in enumerate(zip(seqs, masks)):
            ids[r, :len(s)], attn[r, :len(s)], mask[r, :len(s)], labels[r, :len(s) - 1] = s, 1, m, s[1:]
        adv = torch.tensor(advs)[:, None].expand(-1, S)
        return dict(input_ids=ids, attention_mask=attn), labels, mask, adv

    def _log_probs(self, inputs, labels, with_entropy=False):
        logits = self.model(**inputs).logits.float()
        logp = torch.log_softmax(logits, -1)
        lp = logp.gather(-1, labels[..., None])[..., 0]
        if not with_entropy:
            return lp, None
        with torch.no_grad():
            ent = -(logp.exp() * logp).sum(-1)
        return lp, ent

    def step(self, batch):
        n = batch.prompt_len.shape[0]
        minis = [list(range(s, min(s + self.rows_per_mini, n))) for s in range(0, n, self.rows_per_mini)]
        t0 = CLOCK()
        old = []
        with torch.no_grad():
            for rows in minis:
                inputs, labels, mask, adv = self._inputs(batch, rows)
                old.append((inputs, labels, mask, adv, self._log_probs(inputs, labels)[0]))
        t1 = CLOCK()
        for inputs, labels, mask, adv, old_lp in old:
            self.opt.zero_grad(set_to_none=True)
            lp, ent = self._log_probs(inputs, labels, with_entropy=True)
            ratio = torch.exp(lp - old_lp)
            pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH))
            ntok = mask.sum()
            loss = (pg * mask).sum() / ntok
            loss.backward()
            metrics = torch.stack([loss.detach(), (ent * mask).sum() / ntok])
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            metrics.tolist(), norm.item()  # the trainer reads its loss and norm once per update too
            self.opt.step()
        t2 = CLOCK()
        return t1 - t0, t2 - t1, t2 - t0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batches", type=int, default=3, help="train batches of the demo (its steps 1..N)")
    p.add_argument("--variants", default="ours,ours_apart,hf_packed,hf_padded",
                   help="ours: the demo's config (prompts shared); ours_apart: actor.share_prompts=false")
    p.add_argument("--profile", default=None, help="a variant: print its torch.profiler table and stop")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall: time.perf_counter; cpu: time.thread_time (less inflated by other processes)")
    args = p.parse_args(argv)
    global CLOCK
    CLOCK = time.perf_counter if args.clock == "wall" else time.thread_time
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg, model_dir, batches = demo_setup(args.batches)
    make = {"ours": lambda: Ours(cfg, model_dir), "ours_apart": lambda: Ours(cfg, model_dir, share_prompts=False),
            "hf_packed": lambda: HF(cfg, model_dir, True),
            "hf_padded": lambda: HF(cfg, model_dir, False)}
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        v = make[args.profile]()
        for b in batches:
            v.step(b)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for b in batches:
                v.step(b)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60))
        return
    names = args.variants.split(",")
    variants = {name: make[name]() for name in names}
    for v in variants.values():  # warm-up: allocator, optimizer state, caches
        for b in batches:
            v.step(b)
    phases = ("old", "update", "total")
    times = {name: {k: [] for k in phases} for name in names}  # per repeat: mean over the batches
    for r in range(args.repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        sums = {name: [0.0] * len(phases) for name in names}
        for b in batches:
            for name in order:
                for i, t in enumerate(variants[name].step(b)):
                    sums[name][i] += t
        for name in names:
            for i, k in enumerate(phases):
                times[name][k].append(sums[name][i] / len(batches))
    tokens = statistics.mean(int((b.prompt_len + b.response_len).sum()) for b in batches)
    print(f"demo train batches: {len(batches)} x {batches[0].prompt_len.shape[0]} sequences, {tokens:.0f} tokens "
          f"each (mean); {args.repeats} interleaved repeats, 1 thread, {args.clock} clock; ms per train batch, "
          f"median [min-max] over repeats")
    ref = names[0]
    print(f"{'variant':10s} {'old log-probs':>24s} {'update (4 x)':>24s} {'total':>24s} {'vs ' + ref:>8s}")
    med = {}
    for name in names:
        t = times[name]
        med[name] = statistics.median(t["total"])
        cells = [f"{1e3 * statistics.median(x):7.1f} [{1e3 * min(x):6.1f}-{1e3 * max(x):6.1f}]"
                 for x in (t["old"], t["update"], t["total"])]
        print(f"{name:10s} {cells[0]:>24s} {cells[1]:>24s} {cells[2]:>24s} {med[name] / med[ref]:7.2f}x")


if __name__ == "__main__":
    main()
