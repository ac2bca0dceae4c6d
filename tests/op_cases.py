"""Every public tensor op of ``dapo_kernels`` as a small callable case, for the tests that run all of
them the same way (tests/ops/test_strides.py, tests/ops/test_nan_propagation.py).

A case is built fresh per call (``case.make()``: a dict of the op's arguments by name) and run with
:func:`run_case`, which returns every output and the gradient of every differentiable input under
fixed random cotangents, flattened into ``{label: tensor}``.
"""
from __future__ import annotations

from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch

import dapo_kernels as dk
from tests.helpers import backend, cu_seqlens_from


class OpCase(NamedTuple):
    name: str
    make: Callable[[], Dict]            # fresh arguments by name (tensors and plain values)
    call: Callable[[Dict], object]      # runs the public op on such a dict
    diff: Tuple[str, ...] = ()          # float arguments the op is differentiable w.r.t.
    mask: Optional[str] = None          # the argument that selects tokens (True = in the loss / kept)


def _flatten(prefix: str, out, acc: Dict[str, torch.Tensor]) -> None:
    if isinstance(out, torch.Tensor):
        acc[prefix] = out
    elif isinstance(out, dict):
        for k in sorted(out):
            _flatten(f"{prefix}.{k}", out[k], acc)
    elif isinstance(out, (tuple, list)):
        for i, o in enumerate(out):
            _flatten(f"{prefix}.{getattr(out, '_fields', range(len(out)))[i]}", o, acc)
    elif isinstance(out, (int, float, bool)):
        acc[prefix] = torch.tensor(out)
    elif out is not None:
        raise TypeError(f"{prefix}: unexpected output type {type(out).__name__}")


def run_case(case: OpCase, args: Dict, be: str, seed: int = 0) -> Dict[str, torch.Tensor]:
    """Outputs of ``case`` on backend ``be`` and ``d<arg>``, the gradients of its differentiable
    arguments under cotangents drawn from ``seed`` (the same for every run of the case, so runs
    compare). ``args``' differentiable tensors may be views: gradients are taken w.r.t. exactly
    the tensors passed (non-leaf tensors included)."""
    args = dict(args)
    for n in case.diff:
        if not args[n].requires_grad:
            args[n] = args[n].detach().requires_grad_()
    with backend(be):
        out = case.call(args)
    flat: Dict[str, torch.Tensor] = {}
    _flatten("out", out, flat)
    gen = torch.Generator().manual_seed(seed)
    outs, cots = [], []
    for o in flat.values():
        if o.requires_grad:
            outs.append(o)
            cots.append(torch.randn(o.shape, generator=gen).to(o.dtype))
    if outs:
        with backend(be):
            grads = torch.autograd.grad(outs, [args[n] for n in case.diff], cots, allow_unused=True)
        for n, g in zip(case.diff, grads):
            flat[f"d{n}"] = torch.zeros_like(args[n]) if g is None else g
    return {k: v.detach() for k, v in flat.items()}


# --------------------------------------------------------------------------- inputs
# 14 and 17 share a padded bucket of the CPU attention path; 40 spans two of the interpreter's 32-row blocks.
_LENGTHS = [5, 0, 40, 14, 17]


def _cu() -> torch.Tensor:
    return cu_seqlens_from(_LENGTHS)


def _token_mask(n: int) -> torch.Tensor:
    m = torch.rand(n) > 0.3
    m[:2] = torch.tensor([True, False])  # at least one token in and one out
    return m


def _packing_unpad():
    m = torch.rand(3, 7) > 0.4
    m[0, :2] = torch.tensor([True, False])
    return dict(hidden_states=torch.randn(3, 7, 5), attention_mask=m, unused_mask=(~m) & (torch.rand(3, 7) > 0.5))


def _packing_pad():
    idx = torch.randperm(21)[:9].sort().values
    return dict(hidden_states=torch.randn(9, 4), indices=idx, batch=3, seqlen=7)


def _attention(causal: bool):
    def make():
        cu = _cu()
        t = int(cu[-1])
        return dict(q=torch.randn(t, 2, 16), k=torch.randn(t, 1, 16), v=torch.randn(t, 1, 16), cu_seqlens=cu,
                    max_seqlen=max(_LENGTHS), causal=causal)
    return make


def _linear():
    n, h, v = 20, 32, 80
    return dict(hidden=torch.randn(n, h), weight=torch.randn(v, h) / h ** 0.5, labels=torch.randint(0, v, (n,)))


def _is_weights(n: int) -> torch.Tensor:
    """Rollout IS weights in [0.5, 2) (dk.rollout_correction's ``rollout_is_weights``)."""
    return 0.5 + 1.5 * torch.rand(n)


def _fused(mode: str, is_weights: bool = False):
    def make():
        a = _linear()
        n = a["hidden"].shape[0]
        old = -3 * torch.rand(n)
        a.update(old_log_prob=old, advantages=torch.randn(n), response_mask=_token_mask(n),
                 ref_log_prob=old + 0.3 * torch.randn(n))
        if is_weights:
            a["rollout_is_weights"] = _is_weights(n)
        if mode.startswith("seq"):
            a["cu_seqlens"] = cu_seqlens_from([7, 0, 13])
        return a
    return make


def _policy(mode: str, shape, is_weights: bool = False):
    def make():
        n = torch.Size(shape).numel()
        lp = -3 * torch.rand(n)
        a = dict(log_prob=lp, old_log_prob=lp + 0.3 * torch.randn(n), advantages=torch.randn(n),
                 response_mask=_token_mask(n))
        if is_weights:
            a["rollout_is_weights"] = _is_weights(n)
        a = {k: t.reshape(shape) for k, t in a.items()}
        if mode.startswith("seq") and len(shape) == 1:
            a["cu_seqlens"] = _cu()
        return a
    return make


def _rollout(packed: bool):
    def make():
        n = sum(_LENGTHS) if packed else 4 * 9
        old = -3 * torch.rand(n)
        a = dict(old_log_prob=old, rollout_log_prob=old + 0.2 * torch.randn(n), response_mask=_token_mask(n))
        if packed:
            a["cu_seqlens"] = _cu()
        else:
            a = {k: t.reshape(4, 9) for k, t in a.items()}
        return a
    return make


# Padded: token weights and token-level rejection (a bad token reaches only itself); packed: sequence
# weights and a sequence-level option (a bad token reaches its sequence).
_ROLLOUT_MODES = {False: dict(rollout_is="token", rollout_rs="token_k1,token_k3", rollout_rs_threshold="0.7_1.4,0.05"),
                  True: dict(rollout_is="sequence", rollout_is_threshold=5.0, rollout_rs="seq_mean_k2",
                             rollout_rs_threshold=0.02)}


def _rollout_call(packed: bool):
    return lambda a: dk.rollout_correction(a["old_log_prob"], a["rollout_log_prob"], a["response_mask"],
                                           cu_seqlens=a.get("cu_seqlens"), **_ROLLOUT_MODES[packed])


def _kl():
    lp = -3 * torch.rand(6, 9)
    return dict(log_prob=lp, ref_log_prob=lp + 0.5 * torch.randn(6, 9))


def _group_index():
    gi = torch.randint(0, 5, (23,))
    return dict(scores=(torch.rand(23) > 0.5).float() + 0.1 * torch.randn(23), group_index=gi, num_groups=5)


def _group_size():
    return dict(scores=(torch.rand(24) > 0.5).float(), group_size=4)


def _moe():
    """8 tokens, 4 experts, top-2: expert 3 receives no token; tokens 0 and 1 pick one expert twice."""
    T, H, I, E = 8, 16, 16, 4
    ids = torch.stack([torch.arange(T) % 3, (torch.arange(T) + 1) % 3], 1)
    ids[:2, 1] = ids[:2, 0]
    return dict(hidden_states=torch.randn(T, H), gate_up_proj=torch.randn(E, 2 * I, H) / 4,
                down_proj=torch.randn(E, H, I) / 4, topk_weights=torch.rand(T, 2), topk_ids=ids)


def _fused_call(mode: str):
    def call(a):
        kw = {k: a[k] for k in ("cu_seqlens", "rollout_is_weights") if k in a}
        return dk.fused_linear_policy_loss(a["hidden"], a["weight"], a["labels"], a["old_log_prob"], a["advantages"],
                                           a["response_mask"], ref_log_prob=a["ref_log_prob"], kl_coef=0.1,
                                           entropy_coeff=0.01, temperature=0.9, loss_agg_mode=mode, **kw)
    return call


def _policy_call(mode: str):
    def call(a):
        kw = {k: a[k] for k in ("cu_seqlens", "rollout_is_weights") if k in a}
        return dk.policy_loss(a["log_prob"], a["old_log_prob"], a["advantages"], a["response_mask"],
                              loss_agg_mode=mode, **kw)
    return call


CASES = [
    OpCase("unpad_input", _packing_unpad,
           lambda a: dk.unpad_input(a["hidden_states"], a["attention_mask"], a["unused_mask"]),
           ("hidden_states",), "attention_mask"),
    OpCase("pad_input", _packing_pad, lambda a: dk.pad_input(a["hidden_states"], a["indices"], a["batch"], a["seqlen"]),
           ("hidden_states",)),
    OpCase("packed_position_ids", lambda: dict(cu_seqlens=_cu()),
           lambda a: dk.packed_position_ids(a["cu_seqlens"], sum(_LENGTHS))),
    # deterministic=False (the default): dQ by atomics in the dK/dV kernel; True: the dQ kernel.
    *(OpCase(f"varlen_attention-{'causal' if c else 'full'}{'-deterministic' if det else ''}", _attention(c),
             lambda a, det=det: dk.varlen_attention(a["q"], a["k"], a["v"], a["cu_seqlens"], a["max_seqlen"],
                                                    causal=a["causal"], return_lse=True, deterministic=det),
             ("q", "k", "v"))
      for c, det in ((True, False), (False, False), (True, True))),
    OpCase("linear_log_probs", _linear,
           lambda a: dk.linear_log_probs(a["hidden"], a["weight"], a["labels"], temperature=0.9, return_entropy=True),
           ("hidden", "weight")),
    *(OpCase(f"fused_linear_policy_loss-{m}", _fused(m), _fused_call(m), ("hidden", "weight"), "response_mask")
      for m in ("token-mean", "seq-mean-token-mean")),
    OpCase("fused_linear_policy_loss-is_weights-seq-mean-token-mean", _fused("seq-mean-token-mean", True),
           _fused_call("seq-mean-token-mean"), ("hidden", "weight"), "response_mask"),
    OpCase("kl_penalty", _kl, lambda a: dk.kl_penalty(a["log_prob"], a["ref_log_prob"], "low_var_kl"), ("log_prob",)),
    OpCase("kl_penalty-abs", _kl, lambda a: dk.kl_penalty(a["log_prob"], a["ref_log_prob"], "abs"), ("log_prob",)),
    *(OpCase(f"policy_loss-{m}-{'x'.join(map(str, s))}", _policy(m, s), _policy_call(m),
             ("log_prob", "old_log_prob"), "response_mask")
      for m in dk.LOSS_AGG_MODES for s in ((sum(_LENGTHS),), (6, 9))),
    # With rollout IS weights (the weights not differentiable: constants).
    *(OpCase(f"policy_loss-is_weights-{m}-{'x'.join(map(str, s))}", _policy(m, s, True), _policy_call(m),
             ("log_prob", "old_log_prob"), "response_mask")
      for m, s in (("token-mean", (6, 9)), ("seq-mean-token-sum", (sum(_LENGTHS),)))),
    OpCase("group_filter-index", _group_index,
           lambda a: dk.group_filter(a["scores"], a["group_index"], a["num_groups"])),
    OpCase("group_filter-size", _group_size, lambda a: dk.group_filter(a["scores"], group_size=a["group_size"])),
    *(OpCase(f"rollout_correction-{'packed' if p else 'padded'}", _rollout(p), _rollout_call(p), (), "response_mask")
      for p in (False, True)),
    OpCase("moe_experts", _moe, lambda a: dk.moe_experts(a["hidden_states"], a["gate_up_proj"], a["down_proj"],
                                                       a["topk_weights"], a["topk_ids"]),
           ("hidden_states", "gate_up_proj", "down_proj", "topk_weights")),
    OpCase("overlong_penalty-float", lambda: dict(response_lengths=torch.rand(3, 5) * 120),
           lambda a: dk.overlong_penalty(a["response_lengths"], 100, 30, 0.5)),
    OpCase("overlong_penalty-int", lambda: dict(response_lengths=torch.randint(0, 120, (3, 5))),
           lambda a: dk.overlong_penalty(a["response_lengths"], 100, 30, 0.5)),
]
CASES_BY_NAME = {c.name: c for c in CASES}
