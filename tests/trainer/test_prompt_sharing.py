"""Prompt sharing (``actor_rollout_ref.actor.share_prompts``): the rows of a micro-batch that repeat a
prompt compute it once (:class:`~dapo_trainer.model.PromptSharing`); every sequence still attends over
its own copy of the prompt's keys and values, so hidden states and gradients are those of the sequences
packed apart, in float64 to rounding and in float32 within the tolerance rule."""
from __future__ import annotations

import json
import os

import pytest
import torch

import dapo_kernels as dk
from dapo_kernels.reference import varlen_attention_ref
from dapo_trainer.actor import pack_micro_batch, prompt_sharing
from dapo_trainer.config import load_config
from dapo_trainer.model import FULL, SLIDING, ModelConfig, Transformer, VarlenAttention
from dapo_trainer.trainer import DAPOTrainer
from tests.tolerance import assert_norm_close_to_ref
from tests.trainer.tiny import micro_setup, train_batch

VOCAB, P, R = 40, 7, 6
FAMILIES = {
    "llama-gqa": dict(num_kv_heads=2),
    "qwen3": dict(model_type="qwen3", qk_norm=True, num_kv_heads=1, tie_word_embeddings=True),
    "mistral-window": dict(model_type="mistral", sliding_window=4, num_kv_heads=2),
    "gemma3": dict(model_type="gemma3_text", qk_norm=True, norm_unit_offset=True, hidden_act="gelu_pytorch_tanh",
                   embed_scale=True, sandwich_norms=True, query_pre_attn_scalar=24, sliding_window=3,
                   layer_types=(SLIDING, FULL), rope_local_theta=1e4, num_kv_heads=2, attn_logit_softcapping=5.0),
}


def model_of(family: str) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                      head_dim=8, max_position_embeddings=64, **FAMILIES[family])
    return Transformer(cfg).init_weights(std=0.2)


def grouped_batch(seed: int = 0):
    """Ten rows of four prompts (one of them a single token, one row alone), in no group order; response
    lengths 0 to R (a prompt longer than the sliding windows)."""
    g = torch.Generator().manual_seed(seed)
    which = torch.tensor([2, 0, 1, 0, 3, 1, 0, 2, 1, 0])
    plen = torch.tensor([7, 5, 1, 6])[which]
    prompts = torch.randint(1, VOCAB, (4, P), generator=g)[which]
    prompt_ids = torch.where(torch.arange(P) < plen[:, None], prompts, 0)
    rlen = torch.tensor([6, 1, 0, 4, 5, 3, 6, 2, 6, 3])
    response_ids = torch.randint(1, VOCAB, (len(which), R), generator=g)
    return train_batch(prompt_ids=prompt_ids, response_ids=response_ids, prompt_len=plen, response_len=rlen,
                       sampled=torch.arange(R) < rlen[:, None], advantages=torch.randn(len(which), generator=g)), which


ROWS = [4, 9, 0, 3, 1, 2, 8, 5, 6, 7]  # a micro-batch's rows in planner order


def test_sharing_maps_every_position_to_one_computed_copy():
    """Each repeated prompt is computed once (its first row's copy), every other token once; ``source``
    maps each packed position to a computed row holding the same token at the same sequence position."""
    batch, which = grouped_batch()
    mb = pack_micro_batch(batch, ROWS, torch.device("cpu"), share_prompts=True)
    s = mb.sharing
    plen, rlen = batch.prompt_len[ROWS], batch.response_len[ROWS]
    leaders = {}
    for row in ROWS:
        leaders.setdefault(int(which[row]), row)
    shared = sum(int(batch.prompt_len[r]) for r in ROWS if leaders[int(which[r])] != r)
    assert s.computed.shape[0] == mb.input_ids.shape[0] - shared == int(plen.sum() + rlen.sum()) - shared
    assert torch.equal(mb.input_ids[s.computed][s.source], mb.input_ids)
    pos = dk.packed_position_ids(mb.cu_seqlens, mb.input_ids.shape[0])
    assert torch.equal(pos[s.computed][s.source], pos)
    assert torch.equal(s.source[s.computed], torch.arange(s.computed.shape[0]))  # a computed row is its own source
    # Nothing else changes: labels, mask and advantages keep the packed layout.
    apart = pack_micro_batch(batch, ROWS, torch.device("cpu"))
    for f in ("input_ids", "labels", "mask", "mask_index", "advantages", "cu_seqlens", "response_index"):
        assert torch.equal(getattr(mb, f), getattr(apart, f)), f
    assert apart.sharing is None


def test_rows_with_distinct_prompts_share_nothing():
    """Equal ids but another length is another prompt; no repeat at all: no sharing object."""
    batch, which = grouped_batch()
    distinct = [int((which == k).nonzero()[0]) for k in range(4)]
    assert pack_micro_batch(batch, distinct, torch.device("cpu"), share_prompts=True).sharing is None
    ids = torch.ones(2, P, dtype=torch.long)
    keep = torch.ones(2, P + 1, dtype=torch.bool)
    keep[1, 3:P] = False  # the second row's prompt: its first 3 tokens
    assert prompt_sharing(ids, keep) is None


def attend_float64(self, q, k, v, cu_seqlens, max_seqlen):
    """``VarlenAttention.attend`` through the float64 reference (the kernels take no float64)."""
    return varlen_attention_ref(q, k, v, cu_seqlens, causal=True, softmax_scale=self.softmax_scale,
                                window_size=self.window_size, softcap=self.softcap)[0]


@pytest.fixture
def float64_attention(monkeypatch):
    """The model's attention through the float64 reference, so a float64 model runs end to end."""
    monkeypatch.setattr(VarlenAttention, "attend", attend_float64)


def forward_and_grads(model, mb, sharing, weights):
    """Hidden states ``[T, H]`` and every parameter's gradient of ``sum(hidden * weights)``."""
    model.zero_grad(set_to_none=True)
    h = model(mb.input_ids, mb.cu_seqlens, mb.max_seqlen, sharing=sharing)
    (h * weights).sum().backward()
    return [h.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_float64_shared_forward_and_gradients_equal_packed_apart(family, checkpointing, float64_attention):
    model = model_of(family).double()
    model.activation_checkpointing = checkpointing
    batch, _ = grouped_batch(1)
    mb = pack_micro_batch(batch, ROWS, torch.device("cpu"), share_prompts=True)
    w = torch.randn(mb.input_ids.shape[0], 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    apart = forward_and_grads(model, mb, None, w)
    shared = forward_and_grads(model, mb, mb.sharing, w)
    assert len(shared) == len(apart) > 10  # hidden and the gradient of every parameter the hidden states use
    for a, s in zip(apart, shared):
        assert (a - s).abs().max() <= 1e-12 * a.abs().max(), family


@pytest.mark.parametrize("family", list(FAMILIES))
def test_float32_shared_error_within_the_rule(family, monkeypatch):
    """float32 with the kernels, shared, against the float64 reference: at most 2x the error of the same
    model packed apart in float32 (torch's own way of computing it)."""
    batch, _ = grouped_batch(2)
    mb = pack_micro_batch(batch, ROWS, torch.device("cpu"), share_prompts=True)
    w = torch.randn(mb.input_ids.shape[0], 32, generator=torch.Generator().manual_seed(4))
    model = model_of(family)
    shared = forward_and_grads(model, mb, mb.sharing, w)
    apart = forward_and_grads(model, mb, None, w)
    with monkeypatch.context() as m:
        m.setattr(VarlenAttention, "attend", attend_float64)
        ref = forward_and_grads(model.double(), mb, None, w.double())
    assert_norm_close_to_ref(shared, ref, [apart], name=f"{family} hidden + gradients")


def test_trainer_step_with_shared_prompts_matches(tmp_path):
    """One DAPO step of the micro setup (8 responses per prompt) with and without sharing: the same loss,
    gradient norm and updated weights, to float32 rounding."""
    out = {}
    for share in (False, True):
        root = str(tmp_path / str(share))
        cfg = load_config(overrides=micro_setup(root) + [
            "trainer.val_before_train=false", "trainer.total_training_steps=1", "data.val_files=[]",
            f"actor_rollout_ref.actor.share_prompts={str(share).lower()}"])
        trainer = DAPOTrainer(cfg)
        m = trainer.fit()
        out[share] = m, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        batch, _ = trainer.generation.collect(1)
        assert (trainer.actor.pack(batch, list(range(len(batch.prompt_len)))).sharing is None) != share
    (m0, w0), (m1, w1) = out[False], out[True]
    for k in ("actor/loss", "actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert m1[k] == pytest.approx(m0[k], rel=1e-5, abs=1e-7), k
    for k in w0:
        assert torch.allclose(w1[k], w0[k], rtol=1e-5, atol=1e-6), k


@pytest.mark.parametrize("override, message", [
    ("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "ulysses_sequence_parallel_size=2"),
    ("actor_rollout_ref.actor.pipeline_model_parallel_size=2", "pipeline_model_parallel_size=2"),
    ("actor_rollout_ref.actor.router_replay.mode=R2", "router replay"),
])
def test_unsupported_combinations_name_the_key(override, message):
    with pytest.raises(ValueError, match=rf"'actor_rollout_ref.actor.share_prompts'.*{message}"):
        load_config(overrides=["actor_rollout_ref.actor.share_prompts=true", override])


def test_mixture_of_experts_model_is_refused_before_building(tmp_path):
    path = tmp_path / "moe"
    os.makedirs(path)
    json.dump({"model_type": "qwen3_moe", "num_experts": 4, "max_position_embeddings": 4096},
              open(path / "config.json", "w"))
    message = r"'actor_rollout_ref.actor.share_prompts'.*mixture-of-experts model \(4 experts"
    with pytest.raises(ValueError, match=message):
        load_config(overrides=["actor_rollout_ref.actor.share_prompts=true", f"actor_rollout_ref.model.path={path}"])
