"""The embedded sampler on the sharded training model: TP=2 (vocabulary-parallel Gumbel-max, one
all-gather of per-shard candidates per token) and FSDP2 (one layer gathered at a time, data-parallel
ranks in lockstep) on 2 gloo processes sample what the unsharded model samples with the same seed,
with log-probs as close to the float64 model's as the unsharded float32 model's are (tests/tolerance.py).
"""
from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist

import dapo_kernels as dk
from dapo_kernels.reference.varlen_attention import varlen_attention_ref
from dapo_trainer import ModelConfig, Transformer, load_hf_model, save_hf_model
from dapo_trainer.parallel import apply_fsdp, make_mesh, parallelize
from dapo_trainer.rollout import RolloutConfig, make_rollout
from tests.helpers import spawn_process_group
from tests.tolerance import assert_norm_close_to_ref

WORLD = 2
_BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=16, max_position_embeddings=128)
CONFIGS = {"tied": ModelConfig(**_BASE, tie_word_embeddings=True, qkv_bias=True, model_type="qwen2"),
           "untied": ModelConfig(**_BASE)}
# (temperature, top_p): sampling, a sharper temperature, the nucleus (whose mass needs the
# whole distribution: the one case that gathers the logits), greedy.
CALLS = {"t1": (1.0, 1.0), "t07": (0.7, 1.0), "top_p": (1.0, 0.8), "greedy": (0.0, 1.0)}
N, MAX_NEW, STOPS = 3, 10, (3, 7, 11, 60, 100)


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, _BASE["vocab_size"], (int(k),), generator=g).tolist() for k in (5, 1, 9, 3)]


def _generate(engine, temperature, top_p, prompts, offset=0):
    out = engine.generate(prompts, N, MAX_NEW, temperature=temperature, top_p=top_p, seed=11,
                          stop_token_ids=STOPS, prompt_offset=offset)
    return {"ids": out.response_ids, "lp": out.log_probs, "len": out.lengths}


def _worker(rank: int, root: str):
    torch.set_num_threads(1)
    prompts, res = _prompts(), {}
    gathered = []
    all_gather = dist.all_gather

    def recording_all_gather(parts, t, group=None, **kw):  # what the sampler sends each token
        gathered.append(tuple(t.shape))
        return all_gather(parts, t, group=group, **kw)

    for name in CONFIGS:
        model = load_hf_model(os.path.join(root, name))
        full = sum(p.numel() for p in model.parameters())
        parallelize(model, dist.group.WORLD)
        engine = make_rollout(RolloutConfig(), model)
        res[(name, "tp2", "params")] = sum(p.numel() for p in model.parameters()) / full
        for call, (t, p) in CALLS.items():
            dist.all_gather, gathered[:] = recording_all_gather, []
            try:
                res[(name, "tp2", call)] = _generate(engine, t, p, prompts)
            finally:
                dist.all_gather = all_gather
            res[(name, "tp2", call, "gathers")] = list(gathered)

        # FSDP2: each rank samples its own share (different lengths: the ranks step in lockstep);
        # then rank 1 has no prompts and joins rank 0's gathers with an empty batch.
        model = load_hf_model(os.path.join(root, name))
        apply_fsdp(model, make_mesh("cpu", tp=1)["dp"])
        engine = make_rollout(RolloutConfig(), model)
        lo, hi = (0, 1) if rank == 0 else (1, 4)
        for call, (t, p) in CALLS.items():
            res[(name, "fsdp2", call)] = _generate(engine, t, p, prompts[lo:hi], offset=lo)
        res[(name, "fsdp2", "alone")] = (_generate(engine, 1.0, 1.0, prompts) if rank == 0
                                         else {"empty": engine.generate([], N, MAX_NEW).num_responses})
    torch.save(res, os.path.join(root, f"rank{rank}.pt"))


def _slice(out, lo, hi):
    """Responses of prompts lo..hi-1 of a whole-batch output."""
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), out["len"].cumsum(0)])
    s, e = int(cu[lo * N]), int(cu[hi * N])
    return {"ids": out["ids"][s:e], "lp": out["lp"][s:e], "len": out["len"][lo * N:hi * N]}


def _attention64(q, k, v, cu_seqlens, max_seqlen, **options):
    """dk.varlen_attention in float64 (the kernel takes <= float32): its float64 reference, any options."""
    return varlen_attention_ref(q, k, v, cu_seqlens, **options)[0]


def _log_probs64(model64, out, temperature, monkeypatch):
    """Float64 log-probs of the sampled tokens of ``out`` (a whole-batch output), teacher-forced."""
    prompts, lengths = _prompts(), out["len"].tolist()
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    seqs = [prompts[r // N] + out["ids"][starts[r]:starts[r + 1]].tolist() for r in range(len(lengths))]
    cu = torch.tensor([0, *torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()], dtype=torch.int32)
    # Position P - 1 + j of a response's sequence predicts its token j (P: its prompt's length).
    rows = torch.cat([int(cu[r]) + len(prompts[r // N]) - 1 + torch.arange(n) for r, n in enumerate(lengths)])
    with monkeypatch.context() as m, torch.no_grad():
        m.setattr(dk, "varlen_attention", _attention64)
        logits = model64.logits(model64(torch.tensor(sum(seqs, [])), cu, max(map(len, seqs)))[rows])
    scaled = logits / temperature if temperature > 0 else logits
    return torch.log_softmax(scaled, -1).gather(1, out["ids"][:, None]).squeeze(1)


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_sharded_model_samples_what_the_unsharded_one_does(tmp_path, monkeypatch):
    """Same tokens and lengths as the unsharded model on the whole batch; log-probs whose error against the
    float64 model is within the tolerance rule's factor of the unsharded float32 model's own error: a
    share's batch shape changes the float32 reduction order (BLAS blocking), not the math."""
    torch.manual_seed(0)
    refs, refs64 = {}, {}
    for name, cfg in CONFIGS.items():
        save_hf_model(Transformer(cfg).init_weights(0.3), str(tmp_path / name))
        engine = make_rollout(RolloutConfig(), load_hf_model(str(tmp_path / name)))
        refs[name] = {call: _generate(engine, t, p, _prompts()) for call, (t, p) in CALLS.items()}
        model64 = load_hf_model(str(tmp_path / name)).double()
        refs64[name] = {call: _log_probs64(model64, refs[name][call], t, monkeypatch)
                        for call, (t, p) in CALLS.items()}
    spawn_process_group(_worker, WORLD, str(tmp_path), timeout=datetime.timedelta(seconds=240))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]

    failures = []
    for name, ref in refs.items():
        for rank, res in enumerate(ranks):
            # No replica: a TP rank holds half the weights (norms replicated).
            if not res[(name, "tp2", "params")] < 0.55:
                failures.append(f"{name} rank {rank}: holds {res[(name, 'tp2', 'params')]:.2f} of the model")
            shares = {"tp2": (0, 4), "fsdp2": (0, 1) if rank == 0 else (1, 4)}
            for mode, (lo, hi) in shares.items():
                for call in CALLS:
                    got, want = res[(name, mode, call)], _slice(ref[call], lo, hi)
                    if not (torch.equal(got["ids"], want["ids"]) and torch.equal(got["len"], want["len"])):
                        failures.append(f"{name} {mode} {call} rank {rank}: other tokens than 1 process")
                        continue
                    want64 = _slice({**ref[call], "lp": refs64[name][call]}, lo, hi)["lp"]
                    try:
                        assert_norm_close_to_ref([got["lp"]], [want64], [[want["lp"]]],
                                                 name=f"{name} {mode} {call} rank {rank} log-probs")
                    except AssertionError as e:
                        failures.append(str(e))
            for call, (t, p) in CALLS.items():
                # One all-gather per token of [5, rows] candidates, unless the nucleus needs the logits.
                shapes = res[(name, "tp2", call, "gathers")]
                full_vocab = [s for s in shapes if s[-1] == _BASE["vocab_size"] // WORLD]
                if (p < 1 and t > 0) != bool(full_vocab) or any(s[0] != 5 for s in shapes if s not in full_vocab):
                    failures.append(f"{name} tp2 {call}: all-gathers {shapes}")
        alone = ranks[0][(name, "fsdp2", "alone")]
        if not torch.equal(alone["ids"], ref["t1"]["ids"]):
            failures.append(f"{name} fsdp2: rank 0 alone (rank 1 without prompts) sampled other tokens")
    assert not failures, "\n".join(failures)
