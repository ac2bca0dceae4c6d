"""torch.compile and torch.library.opcheck over every public op.

* Every case of tests/op_cases.py (and unpad -> pad, flash_attn_varlen_func) compiles with
  ``fullgraph=True`` under ``aot_eager`` and gives bit-identical outputs and gradients to eager; a
  second draw of its inputs (same shapes, new values: new ``cu_seqlens``, new mask, hence a new
  ``nnz``) runs the same graph, so no guard reads a value.
* Under ``inductor`` (this CPU's C++ compiler) a few representative cases: identical, or for
  plain-torch elementwise math that inductor re-fuses (``kl_penalty``), within the project's rule of
  2x eager's own fp32 error against the fp64 result.
* Value checks that eager makes on the host (``cu_seqlens``, label range, ``pad_input``'s
  indices) run on the device under compile: a ``RuntimeError`` naming the argument.
* ``torch.library.opcheck`` on every ``dapo::`` custom op, with the arguments the public ops pass
  it (recorded from the cases; ``requires_grad`` as there).
"""
from __future__ import annotations

import functools

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._library.custom_ops import OPDEFS
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

import dapo_kernels as dk
from dapo_kernels._registry import custom_op_names
from dapo_kernels.flash_attn_compat import flash_attn_varlen_func
from dapo_kernels.reference.kl_penalty import kl_penalty_ref
from tests.tolerance import assert_close_to_ref
from tests.op_cases import CASES, CASES_BY_NAME, OpCase, run_case


def _unpad_pad():
    m = torch.rand(3, 7) > 0.4
    m[0, :2] = torch.tensor([True, False])
    return dict(hidden_states=torch.randn(3, 7, 5), attention_mask=m)


def _unpad_pad_call(a):
    x = a["hidden_states"]
    # exact glue (x2, negation): any backend must match eager bit for bit
    x_unpad, indices, cu_seqlens, max_seqlen, seqused = dk.unpad_input(x * 2.0, a["attention_mask"])
    return dk.pad_input(-x_unpad, indices, x.shape[0], x.shape[1]), cu_seqlens, max_seqlen, seqused


_FA = CASES_BY_NAME["varlen_attention-causal"]
EXTRA = [
    OpCase("unpad_input-pad_input", _unpad_pad, _unpad_pad_call, ("hidden_states",)),
    OpCase("flash_attn_varlen_func", _FA.make,
           lambda a: flash_attn_varlen_func(a["q"], a["k"], a["v"], a["cu_seqlens"], a["cu_seqlens"], a["max_seqlen"],
                                            a["max_seqlen"], causal=True, window_size=(3, 0), softcap=5.0),
           ("q", "k", "v")),
]
ALL = {c.name: c for c in CASES + EXTRA}
# Inductor compiles C++ per graph (seconds each): one case per kind of op.
INDUCTOR = ["unpad_input-pad_input", "packed_position_ids", "varlen_attention-causal", "linear_log_probs",
            "fused_linear_policy_loss-seq-mean-token-mean", "policy_loss-seq-mean-token-mean-76", "kl_penalty",
            "group_filter-index"]
# Cases made of plain torch math (no custom op), which inductor may fuse with other roundings: their
# fp64 reference (verl's formula on fp64 inputs).
_PLAIN_TORCH = {"kl_penalty": lambda a: kl_penalty_ref(a["log_prob"], a["ref_log_prob"], "low_var_kl")}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and (
        torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                              and torch.equal(a.nan_to_num(), b.nan_to_num())))


def _compiled(case: OpCase, backend: str):
    counter = CompileCounterWithBackend(backend)
    return case._replace(call=torch.compile(case.call, fullgraph=True, backend=counter)), counter


@pytest.mark.parametrize("name", list(ALL))
def test_compiles_fullgraph_like_eager(name):
    torch._dynamo.reset()
    case = ALL[name]
    compiled, counter = _compiled(case, "aot_eager")
    for draw in range(2):  # new values, same shapes: the same graph
        args = case.make()
        want, got = run_case(case, args, "torch"), run_case(compiled, args, "torch")
        assert got.keys() == want.keys()
        for k in want:
            assert _same(got[k], want[k]), f"draw {draw}: {k} differs from eager"
    assert counter.frame_count == 1, f"compiled {counter.frame_count} times: a guard read a value"


@pytest.mark.parametrize("name", INDUCTOR)
def test_inductor_like_eager(name):
    torch._dynamo.reset()
    case = ALL[name]
    compiled, counter = _compiled(case, "inductor")
    args = case.make()
    want, got = run_case(case, args, "torch"), run_case(compiled, args, "torch")
    assert got.keys() == want.keys()
    if name in _PLAIN_TORCH:
        ref = run_case(case._replace(call=_PLAIN_TORCH[name]), {k: v.double() for k, v in args.items()}, "torch")
    for k in want:
        if name in _PLAIN_TORCH and not _same(got[k], want[k]):
            assert_close_to_ref(got[k], ref[k], want[k], name=k)
        else:
            assert _same(got[k], want[k]), f"{k} differs from eager"
    assert counter.frame_count == 1


def _raises_on_device(fn, *args, match):
    with pytest.raises(RuntimeError, match=match):
        fn(*args)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_value_checks_run_on_the_device_under_compile(backend):
    torch._dynamo.reset()
    n = 10
    lp = torch.randn(n)

    def loss(lp, cu):
        return dk.policy_loss(lp, lp.detach(), lp, torch.ones(n), loss_agg_mode="seq-mean-token-mean", cu_seqlens=cu)[0]

    f = torch.compile(loss, fullgraph=True, backend=backend)
    cu = torch.tensor([0, 4, 6, 10], dtype=torch.int32)
    assert _same(f(lp, cu), loss(lp, cu))
    for bad, what in (([0, 6, 4, 10], "non-decreasing"), ([0, 4, 6, 9], r"\[-1\] must equal"),
                      ([1, 4, 6, 10], r"\[0\]")):
        _raises_on_device(f, lp, torch.tensor(bad, dtype=torch.int32), match=f"cu_seqlens.*{what}")
    # a float mask other than 0 / 1
    g = torch.compile(lambda lp, m: dk.policy_loss(lp, lp.detach(), lp, m)[0], fullgraph=True, backend=backend)
    _raises_on_device(g, lp, torch.full((n,), 0.5), match="response_mask")
    h = torch.compile(lambda x, w, lab: dk.linear_log_probs(x, w, lab), fullgraph=True, backend=backend)
    x, w = torch.randn(4, 8), torch.randn(5, 8)
    labels = torch.tensor([0, 1, -100, 4])
    assert _same(h(x, w, labels)[0], dk.linear_log_probs(x, w, labels)[0])
    for bad in ([0, 1, 5, 4], [0, -1, 2, 4]):
        _raises_on_device(h, x, w, torch.tensor(bad), match="labels must lie in")
    p = torch.compile(lambda x, i: dk.pad_input(x, i, 2, 3), fullgraph=True, backend=backend)
    x = torch.randn(3, 2)
    assert _same(p(x, torch.tensor([0, 2, 5])), dk.pad_input(x, torch.tensor([0, 2, 5]), 2, 3))
    _raises_on_device(p, x, torch.tensor([0, 2, 6]), match="indices must lie in")
    _raises_on_device(p, x, torch.tensor([0, 2, 2]), match="indices must be distinct")


# --------------------------------------------------------------------------- opcheck
class _RecordCustomOps(TorchDispatchMode):
    """The first call of each ``dapo::`` op per (op, flags, which inputs require grad): its arguments."""

    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name.startswith("dapo::"):
            leaves = tree_leaves((args, kwargs))
            key = (name, tuple(x for x in leaves if isinstance(x, bool)),
                   tuple(x.requires_grad for x in leaves if isinstance(x, torch.Tensor)))
            self.calls.setdefault(key, (func, tree_map(
                lambda x: x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x,
                (args, kwargs))))
        return func(*args, **kwargs)


@functools.lru_cache(maxsize=None)
def _recorded_calls():
    rec = _RecordCustomOps()
    gen_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(0)
        for case in CASES:
            with rec:
                run_case(case, case.make(), "torch")
    finally:
        torch.random.set_rng_state(gen_state)
    return rec.calls


@pytest.mark.parametrize("op_name", custom_op_names())
def test_opcheck(op_name):
    calls = [v for k, v in _recorded_calls().items() if k[0] == op_name]
    assert calls, f"no case of tests/op_cases.py calls {op_name}: add one"
    differentiable = OPDEFS[op_name]._backward_fn is not None
    for func, (args, kwargs) in calls:
        if not differentiable:  # a backward op: called without grad, its inputs are saved tensors
            args, kwargs = tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, (args, kwargs))
        torch.library.opcheck(func, args, kwargs)
