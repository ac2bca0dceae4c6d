"""dapo_kernels.integrations.transformers: the "dapo_varlen" attention implementation against
transformers' own sdpa on tiny random Llama / Qwen2 models (built from a config, no download),
packed and padded; and apply_dapo_kernels' fused lm_head + loss.

Tolerance: the project's rule, 2x plain torch's error in fp32 against the same model in fp64, where
plain torch is the less accurate of transformers' two torch attentions, "sdpa" and "eager" (naive
softmax). For the whole model's logits and gradients the rule bounds the error's 2-norm
(tests/tolerance.py assert_norm_close_to_ref): another attention changes the rounding of every op
downstream, and a parameter's max error is set by a few tokens.
"""
from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (requirements-dev.txt)")

import dapo_kernels as dk  # noqa: E402
from dapo_kernels.integrations import transformers as dkt  # noqa: E402
from tests.helpers import backend  # noqa: E402
from tests.tolerance import assert_close_to_ref, assert_norm_close_to_ref  # noqa: E402

V = 64


def _config(arch: str, sliding: bool = False):
    common = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if sliding:  # Qwen2's sliding-window layers (window 4: shorter than the sequences below)
        return transformers.Qwen2Config(**common, use_sliding_window=True, sliding_window=4, max_window_layers=0,
                                        layer_types=["sliding_attention", "full_attention"])
    return transformers.Qwen2Config(**common)


def _models(arch: str, sliding: bool = False):
    """(sdpa fp32, sdpa fp64, dapo_varlen fp32) copies of one random model."""
    base = transformers.AutoModelForCausalLM.from_config(_config(arch, sliding), attn_implementation="sdpa")
    with torch.no_grad():  # bigger than the default init: attention patterns far from uniform
        for p in base.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else None
    ours = copy.deepcopy(base)
    ours.set_attn_implementation("dapo_varlen")
    return base, copy.deepcopy(base).double(), ours


def _packed():
    lengths = [5, 9, 1, 7]
    ids = torch.randint(0, V, (1, sum(lengths)))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    # use_cache=False: a training pass (with a cache transformers' sdpa mask ignores packing)
    return dict(input_ids=ids, position_ids=pos, use_cache=False), torch.ones(1, sum(lengths), dtype=torch.bool)


def _padded():
    ids = torch.randint(0, V, (3, 8))
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[0, 6:] = 0   # right padding
    mask[1, :3] = 0   # left padding
    return dict(input_ids=ids, attention_mask=mask, use_cache=False), mask.bool()


def _logits_and_grads(model, inputs, real, cot):
    model.zero_grad()
    logits = model(**inputs).logits
    (logits[real] * cot.to(logits.dtype)).sum().backward()
    return logits[real].detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _assert_matches_sdpa(models, inputs, real):
    sdpa32, sdpa64, ours = models
    eager32 = copy.deepcopy(sdpa32)
    eager32.set_attn_implementation("eager")
    cot = torch.randn(int(real.sum()), V)
    ref_l, ref_g = _logits_and_grads(sdpa64, inputs, real, cot)
    ways = [_logits_and_grads(m, inputs, real, cot) for m in (sdpa32, eager32)]
    o_l, o_g = _logits_and_grads(ours, inputs, real, cot)

    assert_norm_close_to_ref([o_l], [ref_l], [[w[0]] for w in ways], name="logits")
    names = list(ref_g)
    assert_norm_close_to_ref([o_g[n] for n in names], [ref_g[n] for n in names],
                             [[w[1][n] for n in names] for w in ways], name="parameter gradients")


@pytest.mark.parametrize("batch", ["packed", "padded"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen2-sliding"])
def test_dapo_varlen_matches_sdpa(arch, batch):
    """Whole-model parity on the CPU's backend (torch); the interpreted Triton kernels' accuracy is
    tested per op (tests/ops/test_varlen_attention.py)."""
    models = _models(arch.split("-")[0], sliding=arch.endswith("sliding"))
    inputs, real = (_packed if batch == "packed" else _padded)()
    with backend("torch"):
        _assert_matches_sdpa(models, inputs, real)


def test_packed_equals_separate_sequences():
    """The packed batch is the sequences run one by one (sdpa, no packing): the boundaries are right."""
    sdpa32, _, ours = _models("llama")
    inputs, _ = _packed()
    pos = inputs["position_ids"][0]
    got = ours(**inputs).logits[0]
    starts = (pos == 0).nonzero().flatten().tolist() + [pos.numel()]
    for a, b in zip(starts[:-1], starts[1:]):
        want = sdpa32(input_ids=inputs["input_ids"][:, a:b]).logits[0]
        torch.testing.assert_close(got[a:b], want, rtol=0, atol=1e-5)


def test_whole_rows_share_one_cu_seqlens(monkeypatch):
    """No mask and no position_ids: each row is one sequence, and every layer passes the op the same
    cu_seqlens tensor (its per-batch metadata is built once), a normal tensor even if first built under
    inference_mode."""
    class Attn(torch.nn.Module):
        is_causal = True

    seen = []
    monkeypatch.setattr(dkt, "varlen_attention", lambda q, k, v, cu, *a, **kw: seen.append(cu) or dk.varlen_attention(
        q, k, v, cu, *a, **kw))
    q, k, v = torch.randn(3, 4, 6, 8), torch.randn(3, 2, 6, 8), torch.randn(3, 2, 6, 8)
    with torch.inference_mode():
        dkt.dapo_varlen_attention(Attn(), q, k, v, None)
    out, _ = dkt.dapo_varlen_attention(Attn(), q, k, v, None)
    assert seen[0] is seen[1] and not seen[0].is_inference() and seen[0].tolist() == [0, 6, 12, 18]
    want = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                            is_causal=True)
    torch.testing.assert_close(out, want.transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_from_pretrained_with_dapo_varlen(tmp_path):
    sdpa32, sdpa64, _ = _models("llama")
    sdpa32.save_pretrained(tmp_path)
    ours = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="dapo_varlen")
    assert ours.config._attn_implementation == "dapo_varlen"
    inputs, real = _padded()
    _assert_matches_sdpa((sdpa32, sdpa64, ours), inputs, real)


def test_unsupported_attention_arguments():
    _, _, ours = _models("llama")
    q = torch.randn(1, 4, 5, 8)
    with pytest.raises(NotImplementedError, match="dropout"):
        dkt.dapo_varlen_attention(ours.model.layers[0].self_attn, q, q[:, :2], q[:, :2], None, dropout=0.1)
    with pytest.raises(NotImplementedError, match="KV cache"):
        dkt.dapo_varlen_attention(ours.model.layers[0].self_attn, q, q[:, :2, :3], q[:, :2, :3], None)


# --------------------------------------------------------------------------- apply_dapo_kernels
def _rl_batch():
    inputs, real = _padded()
    labels = inputs["input_ids"].masked_fill(~real, -100)
    response = torch.zeros_like(real)
    response[:, 4:] = True  # the "completion" part of each row
    return inputs, labels, response & real


def _log_probs_full(model, inputs, labels):
    """[B, S] log-prob of each token given the ones before it, from the full logits in the model's dtype
    (0 where not scored)."""
    logits = model(**inputs).logits
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0]
    return torch.nn.functional.pad(torch.where(labels[:, 1:] != -100, lp, 0.0), (1, 0))


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def test_apply_dapo_kernels_log_probs_and_nll():
    sdpa32, sdpa64, _ = _models("qwen2")
    ours = dkt.apply_dapo_kernels(copy.deepcopy(sdpa32))
    assert ours.config._attn_implementation == "dapo_varlen"
    inputs, labels, _ = _rl_batch()
    out = ours(**inputs, labels=labels)
    assert out.logits is None
    out.loss.backward()
    # A row's first real token is never scored: nothing before it predicts it. transformers' loss
    # scores the left-padded row's from a padding position: left out of the reference.
    assert out.log_probs[1, 3] == 0
    labels = labels.clone()
    labels[1, 3] = -100
    n = (labels[:, 1:] != -100).sum()
    want = {}
    for m in (sdpa32, sdpa64):  # transformers' own causal-LM loss on the full logits
        m.zero_grad()
        lp = _log_probs_full(m, inputs, labels)
        loss = m(**inputs, labels=labels).loss
        loss.backward()
        want[m] = (lp.detach(), loss.detach(), _grads(m))
    (lp32, l32, g32), (lp64, l64, g64) = want[sdpa32], want[sdpa64]
    assert torch.equal(out.log_probs == 0, lp64 == 0) and n == (lp64 != 0).sum()
    assert_close_to_ref(out.log_probs.detach(), lp64, lp32, name="log_probs")
    assert_close_to_ref(out.loss.detach(), l64, l32, name="loss")
    got = _grads(ours)
    for k in g64:
        assert_close_to_ref(got[k], g64[k], g32[k], name=f"d {k}")
    # without labels: the model's own forward (logits)
    assert ours(**inputs).logits.shape == (3, 8, V)


@pytest.mark.parametrize("mode,is_weights", [("token-mean", False), ("seq-mean-token-mean", False),
                                             ("token-mean", True)])
def test_apply_dapo_kernels_policy_loss_matches_unfused(mode, is_weights):
    """The patched forward's loss and gradients = dk.policy_loss on log-probs from the full logits
    (fp64 model: the reference; fp32: what plain torch's error is); rollout_is_weights aligned with
    labels like advantages."""
    sdpa32, sdpa64, _ = _models("llama")
    ours = dkt.apply_dapo_kernels(copy.deepcopy(sdpa32), attention=False)
    inputs, labels, response = _rl_batch()
    adv = torch.randn(3, 1).expand(3, 8).contiguous()
    old = _log_probs_full(sdpa64, inputs, labels).float().detach() + 0.1 * torch.randn(3, 8)
    is_w = {"rollout_is_weights": torch.rand(3, 8) + 0.5} if is_weights else {}
    out = ours(**inputs, labels=labels, advantages=adv, old_log_prob=old, response_mask=response,
               loss_agg_mode=mode, clip_ratio_high=0.28, **is_w)
    out.loss.backward()
    scored = response.clone()
    scored[:, 0] = False
    scored[1, 3] = False  # the left-padded row's first real token: nothing predicts it
    want = {}
    for m in (sdpa32, sdpa64):
        m.zero_grad()
        lp = _log_probs_full(m, inputs, labels)
        loss, _ = dk.policy_loss(lp, old.to(lp.dtype), adv.to(lp.dtype), scored, loss_agg_mode=mode,
                                 **{k: v.to(lp.dtype) for k, v in is_w.items()})
        loss.backward()
        want[m] = (loss.detach(), _grads(m))
    (l32, g32), (l64, g64) = want[sdpa32], want[sdpa64]
    assert_close_to_ref(out.loss.detach(), l64.float(), l32, name="loss")
    got = _grads(ours)
    for k in g64:
        assert_close_to_ref(got[k], g64[k], g32[k], name=f"d {k}")
    assert set(out.metrics) >= {"pg_clipfrac", "ppo_kl", "log_prob"}
    assert out.log_probs.shape == (3, 8) and not out.log_probs.requires_grad
