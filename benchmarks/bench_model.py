"""dapo_trainer.model on the CPU: forward + backward tokens/s, packed vs padded batch.

A ~22M-parameter Qwen2-shaped model (hidden 512, 6 layers, GQA 8/4 heads of 64, ffn
1408, tied vocab 8192), float32, one batch of 8 RL-like sequences (lengths uniform in
[S/8, S], S = 256). The step is what training does: hidden states, fused log-probs of
the next token (``dk.linear_log_probs``), masked mean, backward.

* packed: the real tokens laid end to end (``cu_seqlens``), nothing else computed;
* padded: the same sequences right-padded to ``[B, S]``, every row run as a sequence of
  S tokens (what a model without varlen attention does);
* padded input, unpadded inside: ``[B, S]`` in, ``dk.unpad_input`` first
  (``Transformer.forward_padded``), so only real tokens are computed.

tokens/s counts real tokens only; the padding fraction is printed with the table. The
variants alternate within each round (load on the machine hits them alike).
"""
import time

import pytest
import torch

from dapo_trainer import ModelConfig, Transformer
from tests.helpers import cu_seqlens_from

B, S = 8, 256
ROUNDS = 3
CFG = ModelConfig(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_layers=6, num_heads=8,
                  num_kv_heads=4, head_dim=64, qkv_bias=True, tie_word_embeddings=True, model_type="qwen2")


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = Transformer(CFG).init_weights()
    lengths = torch.randint(S // 8, S + 1, (B,)).tolist()
    ids = torch.randint(0, CFG.vocab_size, (B, S))
    mask = torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]
    return model, lengths, ids, mask


def _step(model, hidden, ids, valid):
    labels = torch.roll(ids, -1)
    log_prob, _ = model.log_probs(hidden, labels)
    loss = -(log_prob * valid).sum() / valid.sum()
    loss.backward()
    model.zero_grad(set_to_none=True)


def _packed_valid(cu, n):
    valid = torch.ones(n, dtype=torch.bool)
    valid[cu[1:].long() - 1] = False  # the last token of a sequence has no next token
    return valid


def packed_step(model, lengths, ids, mask):
    packed, cu = ids[mask], cu_seqlens_from(lengths)
    _step(model, model(packed, cu, max(lengths)), packed, _packed_valid(cu, packed.shape[0]))


def padded_step(model, lengths, ids, mask):
    cu = cu_seqlens_from([S] * B)
    valid = mask.clone()
    valid[torch.arange(B), torch.tensor(lengths) - 1] = False
    _step(model, model(ids.flatten(), cu, S), ids.flatten(), valid.flatten())


def unpad_inside_step(model, lengths, ids, mask):
    # The log-probs run on the real tokens only, as a trainer holding a mask would do.
    packed, cu = ids[mask], cu_seqlens_from(lengths)
    hidden = model.forward_padded(ids, mask)[mask]
    _step(model, hidden, packed, _packed_valid(cu, packed.shape[0]))


STEPS = {"packed": packed_step, "padded": padded_step, "padded input, unpadded inside": unpad_inside_step}


@pytest.mark.benchmark(group=f"model fwd+bwd 22M B{B}-S{S}-fp32")
def test_model_fwd_bwd_packed_vs_padded(benchmark, setup):
    # The three variants run alternately within each round, so that load from other
    # processes on the machine hits them alike; best-of-rounds per variant.
    model, lengths, ids, mask = setup
    best = {k: float("inf") for k in STEPS}

    def one_round():
        for name, step in STEPS.items():
            t0 = time.perf_counter()
            step(model, lengths, ids, mask)
            best[name] = min(best[name], time.perf_counter() - t0)

    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    tokens = int(mask.sum())
    pad = 1 - tokens / (B * S)
    lines = [f"{CFG.num_params() / 1e6:.1f}M params, {tokens} real tokens in [{B}, {S}] (padding fraction {pad:.1%}), "
             f"best of {ROUNDS} interleaved rounds:"]
    for name, t in best.items():
        tps = tokens / t
        benchmark.extra_info[f"{name} tokens/s"] = round(tps, 1)
        lines.append(f"  {name:31s} {t:7.2f} s  {tps:8.1f} tokens/s  ({best['padded'] / t:.2f}x padded)")
    benchmark.extra_info["padding fraction"] = round(pad, 3)
    print("\n" + "\n".join(lines))
