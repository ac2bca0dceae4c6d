"""The launches ``benchmarks/gpu/aot.py`` compiles: which kernels exist and how each op's real Triton
launcher is called on small CPU tensors (see :func:`cases` for the two sets)."""
from __future__ import annotations

import ast
import dataclasses
import pathlib
from typing import Callable, Dict, Iterator, List

ROOT = pathlib.Path(__file__).resolve().parents[2]

# The kernels' sources: every module under dapo_kernels/ops (packages included). The one place that
# says where kernels live, with _launchers below.
OPS_DIR = ROOT / "dapo_kernels" / "ops"
ATTN_HEAD_DIMS = (16, 32, 64, 96, 128, 256)  # the rows of varlen_attention's _GPU_TILES
# Head dims between the rows (multiples of 8, masked columns): they compile to other kernels.
ODD_HEAD_DIMS = (8, 40, 80, 112, 160, 200)
# Contiguous group_filter: each power of two up to the widest tile (the kernel's tile shape), and
# sizes that are not multiples of 16 (Triton specialises integer arguments on that).
# rollout_correction's (rollout_is, rollout_is_threshold, rollout_is_batch_normalize): no weights, token TIS,
# sequence IcePop (the kernel's LEVEL / ICEPOP constexprs; the test set skips the first).
RC_MODES = ((None, 2.0, False), ("token", 2.0, False), ("sequence", "0.5_2", True))
GROUP_SIZES = (1, 2, 3, 4, 8, 16, 24, 32, 64, 128, 256, 512, 1024, 2048, 3000, 4096)


def jit_kernels() -> Dict[str, str]:
    """``{kernel name: module path under dapo_kernels/ops}`` for every ``@triton.jit`` function that a
    launcher starts with ``kernel[grid](...)`` (the other jit functions are inlined helpers). An op
    package (a folder) is one unit: its kernels and launchers may sit in different files."""
    found = {}
    for unit in sorted(OPS_DIR.glob("*.py")) + sorted(p for p in OPS_DIR.iterdir() if p.is_dir()):
        trees = {path: ast.parse(path.read_text()) for path in ([unit] if unit.is_file() else unit.rglob("*.py"))}
        launched = {n.func.value.id for tree in trees.values() for n in ast.walk(tree) if isinstance(n, ast.Call)
                    and isinstance(n.func, ast.Subscript) and isinstance(n.func.value, ast.Name)}
        for path, tree in trees.items():
            jitted = {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                      and any(ast.unparse(d).startswith("triton.jit") for d in f.decorator_list)}
            found.update({name: str(path.relative_to(OPS_DIR)) for name in sorted(jitted & launched)})
    return found


def _launchers() -> Dict[str, Callable]:
    """The Triton launchers the cases call (registered by importing dapo_kernels)."""
    import dapo_kernels  # noqa: F401
    from dapo_kernels._registry import _impls
    from dapo_kernels.ops.linear_log_probs import dlogits_triton, row_stats_triton
    names = ("varlen_attention_fwd", "varlen_attention_bwd", "policy_loss_sums", "policy_loss_grad",
             "group_filter", "overlong_penalty", "index_rows", "scatter_rows", "rollout_correction",
             "moe_experts_fwd", "moe_experts_bwd")
    return {**{n: _impls[n]["triton"] for n in names}, "logits_stats": row_stats_triton,
            "logits_grad": dlogits_triton}


# --------------------------------------------------------------------------- launches
@dataclasses.dataclass
class Case:
    """One call of registered Triton launchers on CPU tensors."""
    op: str
    dtype: str
    inputs: str
    call: Callable[[], object]


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _attention(specs) -> Iterator[Case]:
    """``specs``: (dtype, head dim, causal[, variant]) tuples; forward and backward (delta, dK/dV
    with and without atomic dQ, dQ). ``variant`` "local" adds a sliding window and soft-capping
    (the LOCAL / SOFTCAP instances of every kernel); default "plain"."""
    import torch
    launch = _launchers()
    T, Hq, Hkv = 256, 4, 2  # GROUP = 2: the GQA loop of the dK/dV kernel
    for dt, D, causal, *variant in specs:
        local = variant == ["local"]
        masking = (48, -1 if causal else 16, 30.0) if local else (-1, -1, 0.0)  # window left/right, softcap

        def run(dt=dt, D=D, causal=causal, masking=masking):
            q = torch.randn(T, Hq, D, dtype=dt)
            k, v = torch.randn(T, Hkv, D, dtype=dt), torch.randn(T, Hkv, D, dtype=dt)
            cu = torch.tensor([0, 96, T], dtype=torch.int32)
            out, lse = launch["varlen_attention_fwd"](q, k, v, cu, 160, causal, D ** -0.5, *masking)
            for deterministic in (True, False):  # the dQ kernel; dQ by atomics in the dK/dV kernel
                launch["varlen_attention_bwd"](torch.randn_like(q), q, k, v, out, lse, cu, 160, causal,
                                                         D ** -0.5, *masking, deterministic)
        yield Case("varlen_attention", _name(dt),
                   f"D={D} {'causal' if causal else 'full'}{' window+softcap' if local else ''}", run)


def _linear(dtypes) -> Iterator[Case]:
    """The two elementwise kernels of the lm_head ops over a chunk's fp32 logits: the statistics
    (with and without entropy) and dz written over the logits in ``dtype`` (the inputs' dtype)."""
    import torch
    launch = _launchers()
    C, V = 16, 5000  # V > 4096: the GPU tile (4096 columns) and a masked last tile
    for dt in dtypes:
        def run(dt=dt):
            z, lab = torch.randn(C, V), torch.randint(0, V, (C,))
            for entropy in (False, True):
                launch["logits_stats"](z, lab, 1.0, 0, entropy)
            launch["logits_grad"](z, lab, torch.zeros(5, C, dtype=torch.float64), torch.ones(C), torch.ones(C),
                                  1.0, 0, dt)
        yield Case("linear_log_probs", _name(dt), f"C={C} V={V}", run)


def _policy_loss(dtypes) -> Iterator[Case]:
    import torch
    launch = _launchers()
    n = 2048
    for dt in dtypes:
        # token modes: one weight; seq modes: one per token; with and without rollout IS weights (HAS_IS)
        for per_token, has_is in ((False, False), (True, False), (False, True), (True, True)):
            def run(dt=dt, per_token=per_token, has_is=has_is):
                lp, old, adv = (torch.randn(n, dtype=dt) for _ in range(3))
                mask = torch.ones(n, dtype=torch.bool)
                w = torch.ones(n if per_token else 1, dtype=torch.float64)
                is_w = torch.rand(n, dtype=dt) if has_is else None
                launch["policy_loss_sums"](lp, old, adv, mask, w, 0.2, 0.28, 3.0, is_w)
                launch["policy_loss_grad"](torch.ones(()), lp, old, adv, mask, w, 0.2, 0.28, 3.0, is_w)
            yield Case("policy_loss", _name(dt),
                       f"weights [{'N' if per_token else '1'}]{' + rollout IS weights' if has_is else ''}", run)


def _group_filter(score_dtypes, group_sizes, index_dtypes, length_dtypes) -> Iterator[Case]:
    import torch
    launch = _launchers()
    gf = launch["group_filter"]
    for dt in score_dtypes:
        for gs in group_sizes:  # contiguous groups: the [groups, members] tile's shape follows gs
            def contig(dt=dt, gs=gs):
                for norm in (True, False):
                    gf(torch.randn(64 * gs, dtype=dt), torch.empty(0, dtype=torch.int64), 64, gs, 1e-6, norm, 0.0)
            yield Case("group_filter", _name(dt), f"group_size={gs}", contig)
        for it in index_dtypes:  # arbitrary group_index: the three atomics kernels
            def indexed(dt=dt, it=it):
                for norm in (True, False):
                    gf(torch.randn(2048, dtype=dt), torch.randint(0, 64, (2048,), dtype=it), 64, 0, 1e-6, norm, 0.0)
            yield Case("group_filter", _name(dt), f"group_index {_name(it)}", indexed)
    for dt in length_dtypes:
        def overlong(dt=dt):
            launch["overlong_penalty"](torch.arange(2048).to(dt), 96.0, 32.0, 1.0)
        yield Case("overlong_penalty", _name(dt), "lengths", overlong)


def _nan_marks(dtypes, head_dims) -> Iterator[Case]:
    """varlen_attention's NaN marks (row flags, then NaN into the flagged rows) per dtype and head dim:
    D is a constexpr of both kernels."""
    import torch
    from dapo_kernels.ops.varlen_attention import nan_triton
    for dt in dtypes:
        for D in head_dims:
            def marks(dt=dt, D=D):
                x = torch.randn(64, 4, D, dtype=dt)
                nan_triton.mark_rows_nan_(x, nan_triton.nonfinite_rows(x))
            yield Case("varlen_attention", _name(dt), f"NaN marks D={D}", marks)


def _rollout_correction(dtypes, modes) -> Iterator[Case]:
    """Both passes (statistics, write) per dtype and mode; the mode's IS level and IcePop are constexprs."""
    import torch
    from dapo_kernels._rollout_spec import make_params
    launch = _launchers()["rollout_correction"]
    lens = [300, 0, 17, 1024]
    for dt in dtypes:
        for mode in modes:
            def run(dt=dt, mode=mode):
                n = sum(lens)
                old = -torch.rand(n, dtype=dt)
                cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
                p = make_params(*mode, rollout_rs="token_k1,seq_max_k3", rollout_rs_threshold="0.5_2,1")
                launch(old, old, torch.ones(n, dtype=torch.bool), cu, p.as_list())
            yield Case("rollout_correction", _name(dt), f"{mode[0]} {mode[1]}", run)


def _packing(dtypes, widths) -> Iterator[Case]:
    import torch
    launch = _launchers()
    for dt in dtypes:
        for F in widths:  # the feature tile is min(next_pow2(F), 2048) wide
            def run(dt=dt, F=F):
                x, idx = torch.zeros(256, F, dtype=dt), torch.arange(0, 256, 2)
                launch["index_rows"](x, idx)
                launch["scatter_rows"](x[:128], idx, 256)
            yield Case("packing", _name(dt), f"F={F}", run)


def _moe(dtypes) -> Iterator[Case]:
    """moe_experts forward (gate/up GEMM, weighted down GEMM, combine) and backward (gate/up backward, the
    routing weights' and dx's row GEMMs, combine, both weight gradients): 8 experts, top-2, widths that
    are multiples of 16 (the kernels' tiles do not depend on them)."""
    import torch
    from dapo_kernels.ops.moe.permutation import build_permutation
    launch = _launchers()
    T, H, I, E, k = 128, 512, 256, 8, 2
    for dt in dtypes:
        def run(dt=dt):
            x, w = torch.randn(T, H, dtype=dt), torch.rand(T, k, dtype=dt)
            gate_up, down = torch.randn(E, 2 * I, H, dtype=dt), torch.randn(E, H, I, dtype=dt)
            perm = build_permutation(torch.rand(T, E).argsort(-1)[:, :k], E)
            out, gu = launch["moe_experts_fwd"](x, gate_up, down, w, *perm)
            launch["moe_experts_bwd"](torch.randn_like(out), x, gate_up, down, w, gu, *perm)
        yield Case("moe", _name(dt), f"H={H} I={I} E={E} top{k}", run)


def cases(which: str) -> List[Case]:
    """The launches of ``--set which``.

    ``full``: every dtype each op accepts; attention at every supported head dim, causal and not.
    ``test`` (the CPU test's budget): every kernel and every config the pruning keeps for the
    inputs compiled; attention at every head dim once per dtype class, causal and non-causal
    alternating (16-bit: bf16 D=16/64/128 causal, fp16 D=32/96/128 non-causal, bf16 D=256
    non-causal; fp32: D=32/96/256 causal, D=16/64/128 non-causal), two head dims between the
    rows (bf16 80, fp32 112) and two window + soft-capping instances; linear_log_probs in bf16 and
    fp32; the elementwise kernels at one dtype each (their dtype changes only loads and stores),
    group_filter at groups of 4 and 16 (the shapes that spilled before their fix), rollout_correction
    with token and sequence weights in fp32, moe in bf16 and fp32.
    """
    import torch
    f16, bf16, f32, f64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
    ints = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]
    if which == "full":
        return [*_attention([(dt, D, c) for dt in (f16, bf16, f32) for D in ATTN_HEAD_DIMS for c in (True, False)]
                            + [(dt, D, True) for dt in (bf16, f32) for D in ODD_HEAD_DIMS]
                            + [(dt, D, True, "local") for dt in (bf16, f32) for D in (64, 128, 256)]),
                *_linear((f16, bf16, f32)),
                *_policy_loss((f16, bf16, f32, f64)),
                *_group_filter((f32, f64), GROUP_SIZES, (torch.int64, torch.int32), ints + [f32, f64]),
                *_group_filter((f16, bf16), (16,), (torch.int64, torch.int32), ()),
                *_rollout_correction((f16, bf16, f32, f64), RC_MODES),
                *_nan_marks((f16, bf16, f32), ATTN_HEAD_DIMS),
                *_packing((torch.bool, *ints, f16, bf16, f32, f64), (64, 4096)),
                *_moe((f16, bf16, f32))]
    if which == "test":
        return [*_attention([(bf16, 16, True), (f16, 32, False), (bf16, 64, True), (f16, 96, False),
                             (bf16, 128, True), (f16, 128, False), (bf16, 256, False),
                             (f32, 16, False), (f32, 32, True), (f32, 64, False), (f32, 96, True),
                             (f32, 128, False), (f32, 256, True), (bf16, 80, True), (f32, 112, False),
                             (bf16, 128, True, "local"), (f32, 64, False, "local")]),
                *_linear((bf16, f32)),
                *_policy_loss((bf16,)),
                *_group_filter((f64,), (4, 16), (torch.int32,), (torch.int64,)),
                *_rollout_correction((f32,), RC_MODES[1:]),
                *_nan_marks((bf16,), (128,)),
                *_packing((f64,), (4096,)),
                *_moe((bf16, f32))]
    raise ValueError(f"unknown set {which!r}")
