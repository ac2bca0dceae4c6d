"""GPU check of the packing kernels: exactness vs the torch path, GB/s vs copy bandwidth.

B=64, S=4096, hidden 1024 in bf16 and fp32, and hidden 4096 in bf16 (a 2 GiB batch); peer:
flash-attn's recipe in plain torch (nonzero + gather / zeros + index_put). The public ops include
unpad's one host read; the "kernel" rows time the gather / scatter alone (dapo::index_rows /
scatter_rows on prepared indices), the bandwidth the kernel itself reaches. Budget: ~40 s.
"""
import torch

import dapo_kernels as dk
from gpu.common import copy_bandwidth_gbs, cuda_time_ms

from dapo_kernels.ops.packing import index_rows, scatter_rows

B, S = 64, 4096
CASES = ((1024, torch.bfloat16), (1024, torch.float32), (4096, torch.bfloat16))


def _peer_unpad(x, mask):
    idx = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    flat = x.reshape(B * S, -1)
    return torch.gather(flat, 0, idx[:, None].expand(-1, flat.shape[1])), idx


def _peer_pad(xu, idx):
    out = torch.zeros(B * S, xu.shape[1], dtype=xu.dtype, device=xu.device)
    out[idx] = xu
    return out


def run(report):
    bw = None  # (the rows below leave out their share of it if it failed)
    with report.section("packing", "device copy bandwidth", impl="x.copy_(y) 1 GiB"):
        bw = copy_bandwidth_gbs()
        report.add("packing", "device copy bandwidth", impl="x.copy_(y) 1 GiB", metric=f"{bw:.0f} GB/s")
    g = torch.Generator(device="cuda").manual_seed(0)
    lens = torch.randint(S // 8, S + 1, (B,), device="cuda", generator=g)
    mask = torch.arange(S, device="cuda")[None, :] < lens[:, None]
    for H, dtype in CASES:
        case = f"B{B}-S{S}-H{H}-{str(dtype)[6:]}"
        with report.section("packing", case, impl="dk triton vs peer recipe"):
            _case(report, g, mask, H, dtype, case, bw)


def _case(report, g, mask, H, dtype, case, bw):
    """One hidden size and dtype: exactness against the peer recipe, then each timing in its own section."""
    x = torch.randn(B, S, H, device="cuda", dtype=dtype, generator=g)
    with dk.use_backend("triton"):
        xu, idx, cu, mx, _ = dk.unpad_input(x, mask)
        back = dk.pad_input(xu, idx, B, S)
    ref_u, ref_idx = _peer_unpad(x, mask)
    ok = (torch.equal(xu, ref_u) and torch.equal(idx, ref_idx)
          and torch.equal(back.reshape(B * S, H), _peer_pad(ref_u, ref_idx)))
    report.add("packing", case, impl="dk triton vs peer recipe", metric="unpad + pad exact" if ok else "",
               status="ok" if ok else "FAIL", note="" if ok else "differs from the peer recipe")
    x2d = x.reshape(B * S, H)
    # Bytes each direction must move at least: unpad reads and writes nnz rows; pad
    # reads nnz rows and writes all B*S rows.
    timings = (
        ("unpad_input", 2 * xu.numel() * x.element_size(),
         (("dk triton", lambda: dk.unpad_input(x, mask)), ("nonzero+gather", lambda: _peer_unpad(x, mask)))),
        ("pad_input", (xu.numel() + x.numel()) * x.element_size(),
         (("dk triton", lambda: dk.pad_input(xu, idx, B, S)), ("zeros+index_put", lambda: _peer_pad(xu, idx)))),
        ("unpad kernel", 2 * xu.numel() * x.element_size(),
         (("dapo::index_rows", lambda: index_rows(x2d, idx)),)),
        ("pad kernel", (xu.numel() + x.numel()) * x.element_size(),
         (("dapo::scatter_rows", lambda: scatter_rows(xu, idx, B * S)),)),
    )
    for op, nbytes, impls in timings:
        for impl, fn in impls:
            with report.section(op, case, impl=impl), dk.use_backend("triton"):
                ms = cuda_time_ms(fn)
                gbs = nbytes / ms / 1e6
                share = f" ({100 * gbs / bw:.0f}% of copy)" if bw else ""
                report.add(op, case, impl=impl, ms=ms, metric=f"{gbs:.0f} GB/s{share}")
