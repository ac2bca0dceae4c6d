"""The attention kernels' autotune keys carry the launch's length buckets (issue 39): the longest
sequence and the total tokens, each rounded up to a power of two, so an RL step's short and long
packs each time and keep their own config instead of the process's first call picking for all."""
import torch
import triton

import dapo_kernels as dk
from dapo_kernels.ops.varlen_attention import tiles, triton_bwd, triton_fwd_tma, triton_kernels
from dapo_kernels.reference import varlen_attention_ref
from tests.helpers import backend, cu_seqlens_from
from tests.tolerance import assert_close_to_ref

# The kernels the launchers run under the interpreter, with the name of their streamed (autotuned) block.
KERNELS = ((triton_kernels._varlen_attention_fwd_kernel, "BLOCK_N"),
           (triton_bwd._varlen_attention_bwd_dkdv_kernel, "BLOCK_M"),
           (triton_bwd._varlen_attention_bwd_dq_kernel, "BLOCK_N"))


def test_length_buckets_round_up_to_powers_of_two():
    """max_seqlen and total tokens round up to the next power of two (1 for empty launches)."""
    assert tiles._length_buckets(0, 0) == (1, 1)
    assert tiles._length_buckets(1000, 65536) == (1024, 65536)
    assert tiles._length_buckets(1025, 65537) == (2048, 131072)


def test_every_attention_autotuner_keys_on_the_length_buckets():
    """All four autotuned attention kernels (the Hopper forward too) have LENGTH_KEY in their key, and
    the bucket arguments are not specialised on (one compiled kernel serves every bucket)."""
    for kernel in [k for k, _ in KERNELS] + [triton_fwd_tma._varlen_attention_fwd_hopper_kernel]:
        assert kernel.keys[-2:] == tiles.LENGTH_KEY, (kernel.base_fn.__name__, kernel.keys)
        jit = kernel.fn  # an InterpretedFunction keeps the decorator's arguments, a JITFunction its params
        unspecialised = (jit.kwargs.get("do_not_specialize") or () if hasattr(jit, "kwargs")
                         else [p.name for p in jit.params if p.do_not_specialize])
        assert set(tiles.LENGTH_KEY) <= set(unspecialised), (kernel.base_fn.__name__, unspecialised)


def _launch(lengths, seed):
    """(triton out and grads, float64 reference, plain fp32 torch) of one deterministic causal launch (fwd,
    dK/dV, dQ kernels)."""
    torch.manual_seed(seed)
    cu = cu_seqlens_from(lengths)
    q, k, v = (torch.randn(int(cu[-1]), h, 16, dtype=torch.float32).requires_grad_() for h in (2, 1, 1))
    with backend("triton"):
        out = dk.varlen_attention(q, k, v, cu, max(lengths), causal=True, deterministic=True)
    dout = torch.randn_like(out)
    got = (out, *torch.autograd.grad(out, (q, k, v), dout))
    refs = []
    for dtype in (torch.float64, torch.float32):
        ref_out, _ = varlen_attention_ref(q, k, v, cu, causal=True, compute_dtype=dtype)
        refs.append((ref_out, *torch.autograd.grad(ref_out, (q, k, v), dout.to(dtype))))
    return (got, *refs)


def test_two_length_buckets_pick_different_configs(monkeypatch):
    """With a stubbed benchmarker that favours a 16-wide block for short launches (max_seqlen bucket <= 32)
    and a 32-wide one for long ones, a short and a long launch each time both configs and keep a different
    winner per bucket, in every kernel; a second short launch re-uses its bucket's winner without timing;
    each launch's out and gradients match the float64 reference (the picked config is the one that ran)."""
    timed = []
    for kernel, name in KERNELS:
        monkeypatch.setattr(kernel, "configs", [triton.Config({name: bn}, num_warps=1, num_stages=1)
                                                for bn in (16, 32)])
        monkeypatch.setattr(kernel, "cache", {})

        def bench(*args, config, _kernel=kernel, _name=name, **meta):
            bucket = _kernel.nargs["len_bucket"]
            timed.append((_kernel.base_fn.__name__, bucket, config.kwargs[_name]))
            fast = 16 if bucket <= 32 else 32
            return [1.0 if config.kwargs[_name] == fast else 2.0] * 3

        monkeypatch.setattr(kernel, "_bench", bench, raising=False)

    for lengths, seed in (([20, 5, 1], 0), ([70, 33, 9], 1), ([17, 10], 2)):
        got, ref, low = _launch(lengths, seed)
        for name, g, r, t in zip(("out", "dq", "dk", "dv"), got, ref, low):
            assert_close_to_ref(g, r, t, name=f"{lengths} {name}")

    for kernel, name in KERNELS:
        at = len(kernel.keys) - 2  # (Triton appends the tensor arguments' dtypes to the key)
        picks = {key[at:at + 2]: cfg.kwargs[name] for key, cfg in kernel.cache.items()}
        fn = kernel.base_fn.__name__
        assert picks == {(32, 32): 16, (128, 128): 32}, (fn, picks)
        # Each bucket timed both configs once: the third launch, in the first one's bucket, timed nothing.
        assert sorted(c for k, b, c in timed if k == fn) == [16, 16, 32, 32], (fn, timed)

