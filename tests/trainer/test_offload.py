"""Activation offload (dapo_trainer.offload): checkpointed layer inputs leave the device in the
forward and come back in the backward, without changing a bit of the gradients.

On a CPU-only machine host memory is the device's, so the default move is a no-op; the
mechanism is exercised with a fake device policy whose "host" is a serialized byte string:
the tensors really leave (their storage is freed) and come back.
"""
from __future__ import annotations

import gc
import io
import weakref

import pytest
import torch

from dapo_trainer import ModelConfig, Transformer
from dapo_trainer.offload import ActivationOffload, OffloadedTensor
from tests.helpers import cu_seqlens_from

LENGTHS = [9, 1, 23, 14]
CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=2,
                  head_dim=8)


class SerializedOffload(ActivationOffload):
    """Fake device policy: "host" memory is a byte string; records the order of the moves."""

    def __init__(self):
        super().__init__()
        self.sent, self.fetched, self.prefetched, self.refs = [], [], [], []

    def to_host(self, t):
        buf = io.BytesIO()
        torch.save(t.detach(), buf)
        self.refs.append(weakref.ref(t))
        self.sent.append(len(self.sent))
        return OffloadedTensor((self.sent[-1], buf.getvalue()), t.device)

    def prefetch(self, saved):
        self.prefetched.append(saved.host[0])

    def to_device(self, saved):
        self.fetched.append(saved.host[0])
        return torch.load(io.BytesIO(saved.host[1]), weights_only=True).to(saved.device)


def _step(model, offload, *, checkpointing=True):
    """Grads of a token-mean NLL, and how many offloaded inputs were still alive after the forward."""
    model.zero_grad(set_to_none=True)
    model.activation_checkpointing, model.activation_offload = checkpointing, offload
    torch.manual_seed(1)
    ids = torch.randint(0, CFG.vocab_size, (sum(LENGTHS),))
    hidden = model(ids, cu_seqlens_from(LENGTHS), max(LENGTHS))
    gc.collect()
    alive = sum(r() is not None for r in getattr(offload, "refs", []))
    log_prob, _ = model.log_probs(hidden, torch.roll(ids, -1))
    (-log_prob.mean()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, alive


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Transformer(CFG).init_weights(0.2)


def test_offload_gradients_identical_and_inputs_leave(model):
    ref, _ = _step(model, None)
    L, T, H = CFG.num_layers, sum(LENGTHS), CFG.hidden_size
    for offload in (ActivationOffload(), SerializedOffload()):
        grads, alive = _step(model, offload)
        for n, g in ref.items():
            assert torch.equal(grads[n], g), f"{type(offload).__name__}: grad {n} differs with offload"
        # Each layer's hidden-state input went out once and came back once (not the rotary
        # tables or cu_seqlens, which every layer shares).
        s = offload.stats
        assert (s["offloaded"], s["reloaded"], s["bytes"]) == (L, L, L * T * H * 4), s
        assert s["held_bytes"] == 0 and s["peak_held_bytes"] == L * T * H * 4, s
    # The fake host really took them: none of the device copies outlived the forward.
    assert alive == 0 and offload.sent == list(range(L))
    # The backward needs them last layer first, and each reload prefetches the one before it.
    assert offload.fetched == list(range(L))[::-1]
    assert offload.prefetched == list(range(L - 1))[::-1]


def test_offload_needs_checkpointing_and_grad(model):
    offload = SerializedOffload()
    ref, _ = _step(model, None, checkpointing=False)
    grads, _ = _step(model, offload, checkpointing=False)
    assert offload.stats["offloaded"] == 0 and all(torch.equal(grads[n], g) for n, g in ref.items())
    with torch.no_grad():
        model.activation_checkpointing = True
        model(torch.zeros(4, dtype=torch.long), cu_seqlens_from([4]), 4)
    assert offload.stats["offloaded"] == 0
