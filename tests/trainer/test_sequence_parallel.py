"""Ulysses sequence parallelism (dapo_trainer.parallel.apply_sequence_parallel) on 4 gloo CPU processes.

sp=2 (two groups of 2 ranks) and sp=4 equal one process: logits, log-probs, the fused policy
loss (token mean over the global count) and every gradient (summed over the SP group), on a
pack whose sequences cross the shard boundaries (uneven shards, length-1 sequences), for GQA
with 1, 2 and 4 KV heads under 4 query heads. Tolerance: the project's rule, at most 2x the
error of the same step on one process in float32 against a float64 reference (attention,
log-probs and loss of the reference through dapo_kernels.reference).
"""
from __future__ import annotations

import datetime
import os
import zlib

import pytest
import torch
import torch.distributed as dist

import dapo_kernels as dk
from dapo_kernels.reference import fused_linear_policy_loss_ref, linear_log_probs_ref, varlen_attention_ref
from dapo_trainer import ModelConfig, Transformer, load_hf_model, save_hf_model
from dapo_trainer.offload import ActivationOffload
from dapo_trainer.parallel import apply_sequence_parallel, parallelize, shard_sequence, sp_micro_batches
from tests.helpers import cu_seqlens_from, spawn_process_group
from tests.tolerance import max_abs_err
from tests.trainer.collective_audit import CollectiveAudit

WORLD = 4
# 70 tokens: sp=2 cuts at 35 (inside the 12-token sequence), sp=4 at 17, 35, 52 (uneven 17/18
# shards, three cuts inside sequences); two length-1 sequences.
LENGTHS = [7, 1, 19, 12, 5, 1, 9, 16]
KV_HEADS = (1, 2, 4)
_BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, head_dim=8)


def _config(kv: int) -> ModelConfig:
    return ModelConfig(**_BASE, num_kv_heads=kv, qkv_bias=kv == 2, model_type="qwen2" if kv == 2 else "llama")


def _step(model, inp, sp_group=None, *, loss_fn=dk.fused_linear_policy_loss, log_probs=None, max_seqlen=max(LENGTHS)):
    """Forward, logits, log-probs, the fused DAPO loss (token mean over the global count), backward.

    Under SP every per-token input is sharded like the model's output; returns this rank's
    logits / log-probs and its share of the loss."""
    local = (lambda t: shard_sequence(t, sp_group)) if sp_group is not None else (lambda t: t)
    hidden = model(inp["ids"], inp["cu"], max_seqlen)
    logits = model.logits(hidden)
    labels = local(inp["labels"])
    log_prob = (log_probs or model.log_probs)(hidden, labels)[0]
    out = loss_fn(hidden, model.lm_head.weight, labels, local(inp["old"]), local(inp["adv"]), local(inp["mask"]),
                  num_tokens=int(inp["mask"].sum()))
    out[0].backward()
    return logits.detach(), log_prob.detach(), out[0].detach()


def _run(name: str, sp_group, workdir: str, inp, *, checkpointing: bool, offload: bool) -> dict:
    model = load_hf_model(os.path.join(workdir, name))
    apply_sequence_parallel(model, sp_group)
    model.activation_checkpointing = checkpointing
    model.activation_offload = ActivationOffload() if offload else None
    logits, log_prob, loss = _step(model, inp, sp_group)
    # Each rank's gradient covers the loss of its tokens: the full gradient is their sum.
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g, group=sp_group)
        grads[n] = g
    dist.all_reduce(loss, group=sp_group)
    return dict(logits=logits, log_prob=log_prob, loss=loss, grads=grads,
                offloaded=model.activation_offload.stats["offloaded"] if offload else 0)


def _errors(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def _worker(rank: int, workdir: str):
    torch.set_num_threads(1)
    inp = torch.load(os.path.join(workdir, "inputs.pt"), weights_only=True)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    results = {}
    with CollectiveAudit(simulate="cuda") as audit:
        for kv in KV_HEADS:
            name = f"kv{kv}"
            # Ranks 2-3 also recompute (collectives in the backward) and offload.
            audit.phase = f"sp2-{kv}"
            results[("sp2", kv)] = _run(name, pair, workdir, inp, checkpointing=rank >= 2, offload=rank >= 2)
            audit.phase = f"sp4-{kv}"
            results[("sp4", kv)] = _run(name, dist.group.WORLD, workdir, inp, checkpointing=kv == 2, offload=False)
    results["all_to_all"] = {k: v for k, v in audit.counts().items() if k[1] == "all_to_all_single"}
    bad = {"heads": ModelConfig(**{**_BASE, "num_heads": 2}, num_kv_heads=1),
           "kv_heads": ModelConfig(**{**_BASE, "num_heads": 12}, num_kv_heads=3)}
    results["errors"] = {k: _errors(lambda: apply_sequence_parallel(Transformer(c), dist.group.WORLD))
                         for k, c in bad.items()}
    tp_model = parallelize(Transformer(_config(2)), pair)
    results["errors"]["tp"] = _errors(lambda: apply_sequence_parallel(tp_model, pair))
    torch.save(results, os.path.join(workdir, f"rank{rank}.pt"))


def _ref_attention(q, k, v, cu_seqlens, max_seqlen, **options):
    return varlen_attention_ref(q, k, v, cu_seqlens, **options)[0]


def _ref_loss(hidden, weight, labels, old, adv, mask, *, num_tokens):
    return fused_linear_policy_loss_ref(hidden, weight, labels, old.double(), adv.double(), mask,
                                        num_tokens=num_tokens)


def _single(ckpt: str, inp, dtype, monkeypatch=None) -> dict:
    """The step on one process: float32 through dapo_kernels, float64 through the references."""
    model = load_hf_model(ckpt, dtype=dtype)
    if dtype == torch.float64:
        with monkeypatch.context() as m:
            m.setattr(dk, "varlen_attention", _ref_attention)
            logits, log_prob, loss = _step(model, inp, loss_fn=_ref_loss,
                                           log_probs=lambda h, lab: linear_log_probs_ref(h, model.lm_head.weight, lab))
    else:
        logits, log_prob, loss = _step(model, inp)
    return dict(logits=logits, log_prob=log_prob, loss=loss, grads={n: p.grad for n, p in model.named_parameters()})


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_ulysses_sp2_sp4_equal_one_process(tmp_path, monkeypatch):
    torch.manual_seed((int(os.environ["DAPO_TEST_SEED"]) + zlib.crc32(b"test_sequence_parallel")) % 2**31)
    T = sum(LENGTHS)
    ids = torch.randint(0, _BASE["vocab_size"], (T,))
    cu = cu_seqlens_from(LENGTHS)
    mask = torch.rand(T) < 0.8
    mask[cu[1:].long() - 1] = False  # the last token of a sequence predicts nothing
    inp = dict(ids=ids, cu=cu, labels=torch.roll(ids, -1), mask=mask, adv=torch.randn(T),
               old=torch.full((T,), -4.0) + 0.5 * torch.randn(T))  # ratios spread over both clip bounds
    torch.save(inp, tmp_path / "inputs.pt")
    refs = {}
    for kv in KV_HEADS:
        save_hf_model(Transformer(_config(kv)).init_weights(0.2), str(tmp_path / f"kv{kv}"))
        ckpt = str(tmp_path / f"kv{kv}")
        refs[kv] = (_single(ckpt, inp, torch.float64, monkeypatch), _single(ckpt, inp, torch.float32))

    spawn_process_group(_worker, WORLD, str(tmp_path), timeout=datetime.timedelta(seconds=300))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]

    failures, table, worst = [], [], 0.0
    runs = [("sp2 ranks 0-1", "sp2", ranks[:2]), ("sp2 ranks 2-3 (ckpt+offload)", "sp2", ranks[2:]),
            ("sp4", "sp4", ranks)]
    for kv in KV_HEADS:
        ref64, plain = refs[kv]
        def plain_err(k):
            if k == "grads":
                return max(max_abs_err(plain["grads"][n], g) for n, g in ref64["grads"].items())
            return max_abs_err(plain[k], ref64[k])
        table.append(f"kv_heads={kv}  sp=1 fp32 error vs fp64: "
                     + " ".join(f"{k}={plain_err(k):.1e}" for k in ("logits", "log_prob", "loss", "grads")))
        for label, key, group in runs:
            res = [r[(key, kv)] for r in group]
            got = {"logits": torch.cat([r["logits"] for r in res]), "log_prob": torch.cat([r["log_prob"] for r in res]),
                   "loss": res[0]["loss"]}
            pairs = [(k, got[k], ref64[k], plain[k]) for k in got]
            pairs += [(f"grad {n}", r["grads"][n], g, plain["grads"][n])
                      for r in res for n, g in ref64["grads"].items()]
            ratios = {}
            for what, out, want, base in pairs:
                scale = want.double().abs().max().item()
                bound = 2 * max(max_abs_err(base, want), torch.finfo(torch.float32).eps * scale)
                err = max_abs_err(out, want)
                kind = what.split()[0]
                ratios[kind] = max(ratios.get(kind, 0.0), err / bound)
                if err > bound:
                    failures.append(f"kv={kv} {label}: {what} error {err:.2e} > 2x sp=1 fp32 error ({bound:.2e})")
            worst = max(worst, *ratios.values())
            table.append(f"kv_heads={kv}  {label:30s} error / (2x sp=1 fp32 error): "
                         + " ".join(f"{k}={v:.2f}" for k, v in ratios.items()))
            if "offload" in label and any(r["offloaded"] != _BASE["num_layers"] for r in res):
                failures.append(f"kv={kv} {label}: offloaded {[r['offloaded'] for r in res]} layer inputs, "
                                f"expected {_BASE['num_layers']}")
    print("\n".join(table + [f"worst ratio {worst:.2f}"]))
    assert not failures, "\n".join(failures)

    # 4 all-to-alls per layer forward (q, k, v, out) and 4 backward; recompute adds 4 more.
    L = _BASE["num_layers"]
    for r, res in enumerate(ranks):
        counts = res["all_to_all"]
        for kv in KV_HEADS:
            ckpt2 = r >= 2
            assert counts[(f"sp2-{kv}", "all_to_all_single")] == L * (8 + 4 * ckpt2), (r, kv, counts)
            assert counts[(f"sp4-{kv}", "all_to_all_single")] == L * (8 + 4 * (kv == 2)), (r, kv, counts)
        errs = res["errors"]
        assert "num_heads (2) must be divisible by the sequence-parallel size 4" in errs["heads"]
        assert "num_kv_heads (3) must divide or be divisible by the sequence-parallel size 4" in errs["kv_heads"]
        assert "tensor-parallel model is not supported" in errs["tp"]


def test_sp_micro_batches_cap_per_group_and_attention_balance():
    """An SP group's micro-batch holds sp x the per-rank cap (each rank's shard stays under the
    cap, a sequence may be longer than it) and micro-batches balance attention workload."""
    lens = [3000, 500, 500, 500, 500, 500, 500, 2000, 1000, 1000]
    cap, sp, hidden = 2048, 2, 64
    with pytest.raises(ValueError, match="exceeds max_token_len"):
        dk.micro_batches(lens, cap)  # without SP the 3000-token sequence does not fit
    micro = sp_micro_batches(lens, cap, hidden_size=hidden, sp=sp)
    assert sorted(i for mb in micro for i in mb) == list(range(len(lens)))
    for mb in micro:
        tokens = sum(lens[i] for i in mb)
        assert tokens <= cap * sp and -(-tokens // sp) <= cap, (mb, tokens)
    work = dk.attention_workload(lens, hidden)

    def spread(mbs):
        sums = [int(sum(work[i] for i in mb)) for mb in mbs]
        return max(sums) - min(sums)

    by_tokens = dk.micro_batches(lens, cap * sp)
    assert len(micro) == len(by_tokens)
    assert spread(micro) < spread(by_tokens), (micro, by_tokens)


# 32k tokens; the 12000-token sequence crosses the sp=2 cut at 16384.
LONG_LENGTHS = [12000, 9000, 7000, 4768]


def _long_worker(rank: int, workdir: str):
    torch.set_num_threads(1)
    import time

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                                    num_kv_heads=1, head_dim=16)).init_weights()
    apply_sequence_parallel(model, dist.group.WORLD)
    model.activation_checkpointing, model.activation_offload = True, ActivationOffload()
    T = sum(LONG_LENGTHS)
    ids = torch.randint(0, 64, (T,))
    t0 = time.perf_counter()
    _, log_prob, loss = _step(model, dict(ids=ids, cu=cu_seqlens_from(LONG_LENGTHS), labels=torch.roll(ids, -1),
                                          mask=torch.ones(T, dtype=torch.bool), adv=torch.randn(T),
                                          old=torch.full((T,), -4.0)), dist.group.WORLD, max_seqlen=max(LONG_LENGTHS))
    seconds = time.perf_counter() - t0
    grads = {n: p.grad for n, p in model.named_parameters()}
    torch.save(dict(seconds=seconds, tokens=log_prob.shape[0], loss=loss, offloaded=model.activation_offload.stats,
                    finite=all(bool(g.isfinite().all()) for g in grads.values()) and bool(log_prob.isfinite().all()),
                    zero=[n for n, g in grads.items() if not g.abs().sum() > 0]),
               os.path.join(workdir, f"long{rank}.pt"))


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_32k_token_pack_sp2_forward_backward(tmp_path):
    """A 32768-token pack (a 12000-token sequence across the shard cut) through a small model,
    forward + backward with sp=2, checkpointing and offload, on the CPU."""
    spawn_process_group(_long_worker, 2, str(tmp_path), timeout=datetime.timedelta(seconds=300))
    res = [torch.load(tmp_path / f"long{r}.pt", weights_only=True) for r in range(2)]
    print(f"32k-token pack, sp=2: forward + backward {max(r['seconds'] for r in res):.1f} s per rank")
    assert [r["tokens"] for r in res] == [16384, 16384]
    for r in res:
        assert r["finite"] and torch.isfinite(r["loss"]) and not r["zero"], r
        assert r["offloaded"]["offloaded"] == 1 and r["offloaded"]["bytes"] == 16384 * 32 * 4, r["offloaded"]
