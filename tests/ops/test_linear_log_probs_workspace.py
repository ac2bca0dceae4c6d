"""``linear_log_probs.workspace_bytes`` against the bytes the Triton path's CPU run holds at its peak
beyond the returned gradients: the CPU allocator's allocations and frees, in order, as the
profiler records them (inside the custom ops too). fp32 inputs: the CPU run of 16-bit inputs makes
fp32 operand copies that cuBLAS' fp32-output GEMM does not (gpu_check compares the model with the
GPU's peak for bf16)."""
import gc

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import dapo_kernels as dk
import dapo_kernels.ops.linear_log_probs as llp
from tests.helpers import backend
from tests.linear_log_probs_ways import fused_loss_step, make_linear

N, H, V = 96, 16, 3000


def _peak_bytes(fn) -> int:
    """Largest sum of live CPU allocations made while ``fn`` runs (the ones before it not counted)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    cur = peak = 0
    for _, nbytes in events:
        cur += nbytes
        peak = max(peak, cur)
    return peak


@pytest.fixture(params=[N, 20], ids=["one-chunk", "five-chunks"])
def chunked(request, monkeypatch):
    monkeypatch.setattr(llp, "_CHUNK_BYTES", request.param * 4 * V)
    assert llp.chunk_rows(N, V) == request.param
    # The Triton interpreter leaves reference cycles around a launch's arguments (a compiled launch
    # holds none): collected after each launch, so buffers die when the op lets go of them.
    for name in ("_logits_stats_kernel", "_logits_grad_kernel"):
        kernel = getattr(llp, name)
        monkeypatch.setattr(llp, name, _Collected(kernel))


class _Collected:
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.kernel[grid](*args, **kwargs)
            gc.collect()
        return launch


def _check(peak: int, what: str):
    measured = peak - 4 * (N * H + V * H)  # the returned dH and dW
    model = llp.workspace_bytes(N, H, V, torch.float32)
    logits = 4 * llp.chunk_rows(N, V) * V
    print(f"{what}: measured {measured} B, model {model} B (logits chunk {logits} B)")
    assert logits <= measured <= model, f"{what}: measured {measured} B vs model {model} B"


def test_fused_loss_workspace_within_model(chunked):
    """Forward and backward of the fused loss: the peak beyond dH / dW lies between the logits chunk
    alone and the model."""
    _, step = fused_loss_step(N, H, V, torch.float32)
    with backend("triton"):
        _check(_peak_bytes(step), "fused loss")


def test_linear_log_probs_workspace_within_model(chunked):
    """linear_log_probs' forward (the logits chunk and the statistics), then its backward."""
    hidden, weight, labels = make_linear(N, H, V, torch.float32)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()

    def step():
        lp, ent = dk.linear_log_probs(h, w, labels, return_entropy=True)
        (lp.sum() + ent.sum()).backward()

    with backend("triton"):
        _check(_peak_bytes(step), "linear_log_probs")
