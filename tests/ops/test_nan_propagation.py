"""NaN / +inf / -inf in every float input of every public op, on both backends.

For each op, each float input and each of NaN, +inf, -inf (at a position a mask selects and at one
it selects away, where the op has a mask), the two backends must agree: the same NaN, +inf and -inf
entries in every output and gradient, and finite entries as close as on the clean inputs. Each op
then meets its documented semantics (see the op's docstring):

* NaN in -> NaN out: the outputs that depend on the NaN are NaN (exactly those, where the op's
  structure says which: a copied element, a token's row, the queries that attend a key);
* what does not depend on it - other tokens, other sequences, and tokens a mask selects away
  (as torch.where selects them away in verl's losses) - is bitwise what the clean inputs give.

Integer-only ops are not applicable: ``packed_position_ids`` (int ``cu_seqlens``) and
``overlong_penalty`` of integer lengths have no float input to poison
(``test_integer_only_ops_have_no_float_input`` checks that claim).
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import pytest
import torch

from tests.helpers import BACKENDS, backend
from tests.tolerance import eps
from tests.op_cases import CASES, OpCase, run_case

VALUES = {"nan": float("nan"), "+inf": float("inf"), "-inf": -float("inf")}
_INTEGER_ONLY = ("packed_position_ids", "overlong_penalty-int")
_FLOAT_CASES = [c for c in CASES if c.name not in _INTEGER_ONLY]

Spec = Dict[str, Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]]


# --------------------------------------------------------------------------- where to poison
def _placements(case: OpCase, args: Dict):
    """(argument, index, where) triples: one position per float input, two (a selected token and one
    selected away) for inputs a mask applies to; attention keys/values also at a sequence's first
    token, which the CPU path's padded bucket of the previous sequence reads as padding."""
    out = []
    mask = args[case.mask] if case.mask else None
    for name, t in args.items():
        if not (isinstance(t, torch.Tensor) and t.is_floating_point()):
            continue
        if name == "hidden_states" and case.name == "unpad_input":
            packed = (args["attention_mask"] | args["unused_mask"]).reshape(-1)
            for where, sel in (("packed", packed), ("padding", ~packed)):
                pos = int(torch.nonzero(sel)[0])
                out.append((name, (pos // t.shape[1], pos % t.shape[1], 2), where))
        elif case.name.startswith("varlen_attention"):
            cu = args["cu_seqlens"].tolist()
            rows = [cu[2] + 5] + ([cu[4]] if name != "q" else [])
            out += [(name, (r, 0, 3), f"token{r}") for r in rows]
        elif mask is not None and t.shape[:mask.dim()] == mask.shape:  # one value (or row) per token
            for where, sel in (("selected", mask), ("masked", ~mask)):
                pos = int(torch.nonzero(sel.reshape(-1))[0])
                out.append((name, _unravel(pos, t.shape, token_dims=mask.dim()), where))
        else:
            out.append((name, tuple(min(3, s - 1) for s in t.shape), ""))
    return out


def _unravel(pos: int, shape, token_dims: int):
    idx = []
    for s in reversed(shape[:token_dims]):
        idx.append(pos % s)
        pos //= s
    return tuple(reversed(idx)) + (1,) * (len(shape) - token_dims)


# --------------------------------------------------------------------------- documented semantics
def _attended_by(bad: torch.Tensor, cu, causal: bool, keys: bool) -> torch.Tensor:
    """bool [T, H]: queries that attend a bad key (``keys=False``) or keys a bad query attends
    (``keys=True``), sequence by sequence, from the definition of (causal) attention."""
    out = torch.zeros_like(bad)
    for s, e in zip(cu[:-1], cu[1:]):
        for i in range(s, e):
            lo, hi = (s, i + 1) if not keys else (i, e)
            out[i] = bad[lo:hi].any(0) if causal else bad[s:e].any(0)
    return out


def _spec(case: OpCase, args: Dict, clean: Dict, name: str, idx, where: str) -> Spec:
    """{output: (exact NaN pattern for a NaN input or None, entries equal to the clean run or None)}."""
    def mask_of(label, fill=False):
        return torch.full(clean[label].shape, fill, dtype=torch.bool)

    def only(label, ix):
        m = mask_of(label)
        m[ix] = True
        return m

    all_same = {k: (mask_of(k), mask_of(k, True)) for k in clean}
    n = case.name
    if n == "unpad_input":
        if where == "padding":
            return all_same
        flat = idx[0] * args["hidden_states"].shape[1] + idx[1]
        row = int(torch.nonzero(clean["out.1"] == flat)[0])
        hit = only("out.0", (row, idx[2]))
        return {**all_same, "out.0": (hit, ~hit)}
    if n == "pad_input":
        r = int(args["indices"][idx[0]])
        hit = only("out", (r // args["seqlen"], r % args["seqlen"], idx[1]))
        return {**all_same, "out": (hit, ~hit)}
    if n.startswith("varlen_attention"):
        cu, causal = args["cu_seqlens"].tolist(), args["causal"]
        hq, hkv = args["q"].shape[1], args["k"].shape[1]
        bad = mask_of("out.0")[:, :, 0] if name == "q" else torch.zeros(clean["dk"].shape[:2], dtype=torch.bool)
        bad[idx[0], idx[1]] = True
        poisoned = bad if name == "q" else _attended_by(bad, cu, causal, keys=False).repeat_interleave(hq // hkv, 1)
        keys = _attended_by(poisoned.reshape(-1, hkv, hq // hkv).any(-1), cu, causal, keys=True)
        out = poisoned[:, :, None].expand(clean["out.0"].shape)
        dkv = keys[:, :, None].expand(clean["dk"].shape)
        return {"out.0": (out, ~out), "out.1": (poisoned.t(), ~poisoned.t()), "dq": (out, ~out),
                "dk": (dkv, ~dkv), "dv": (dkv, ~dkv)}
    if n == "linear_log_probs":
        if name == "weight":
            return {k: (mask_of(k, True), None) for k in clean}
        row = only("out.0", idx[0])
        dh = mask_of("dhidden")
        dh[idx[0]] = True
        return {"out.0": (row, ~row), "out.1": (row, ~row), "dhidden": (dh, ~dh),
                "dweight": (mask_of("dweight", True), None)}
    if n.startswith("fused_linear_policy_loss"):
        token = idx[0] if name != "weight" else None
        if where == "masked":
            spec = dict(all_same)
            if name == "hidden":  # its own log-prob / entropy metrics are NaN; loss and gradients untouched
                for k in ("out.1.log_prob", "out.1.entropy"):
                    row = only(k, token)
                    spec[k] = (row, ~row)
            return spec
        spec = {"out.0": (mask_of("out.0", True), None)}
        if name == "rollout_is_weights":  # the pg term and the token's own gradient only; metrics untouched
            spec = {k: (None, mask_of(k, True)) for k in clean if k.startswith("out.1.") and k != "out.1.pg_loss"}
            spec.update({k: (mask_of(k, True), None) for k in ("out.0", "out.1.pg_loss")})
        if token is not None:
            other = mask_of("dhidden", True)
            other[token] = False
            spec["dhidden"] = (None, other)
        return spec
    if n.startswith("kl_penalty"):
        hit = only("out", idx)
        return {"out": (hit, ~hit), "dlog_prob": (None, ~hit)}
    if n.startswith("policy_loss"):
        if where == "masked":
            return all_same
        spec = {"out.0": (mask_of("out.0", True), None)}
        if name not in ("advantages", "rollout_is_weights"):  # the metrics are unweighted
            spec["out.1.ppo_kl"] = (mask_of("out.1.ppo_kl", True), None)
        for d in ("dlog_prob", "dold_log_prob"):
            spec[d] = (None, ~only(d, idx))
        return spec
    if n.startswith("group_filter"):
        # Documented: a non-finite score is flagged and its group dropped (advantages 0), nothing NaN.
        return {k: (mask_of(k), None) for k in clean}
    if n.startswith("rollout_correction"):
        # Documented: a dropped token reaches nothing; a selected one its own weight and verdict (token
        # modes) or its sequence's (sequence modes); the metrics are only compared across backends.
        if where == "masked":
            return all_same
        hit = only("out.response_mask", idx)
        if "cu_seqlens" in args:
            cu = args["cu_seqlens"].tolist()
            s = max(i for i in range(len(cu) - 1) if cu[i] <= idx[0])
            hit[cu[s]:cu[s + 1]] = True
        nan = hit & args[case.mask]
        return {"out.rollout_is_weights": (nan, ~hit), "out.response_mask": (None, ~hit)}
    if n == "moe_experts":
        # A token's row reaches its own output and input-gradient rows and the weight gradients of the
        # experts it picks (None: those patterns are not pinned); an expert's weight reaches the tokens
        # that pick it; a routing weight its token's output and dx rows and its expert's weight gradients
        # (not its own gradient, dout . y). Everything else is what the clean inputs give.
        ids = args["topk_ids"]
        if name == "hidden_states":
            tok, experts = torch.zeros(ids.shape[0], dtype=torch.bool), ids[idx[0]].unique()
            tok[idx[0]] = True
        elif name in ("gate_up_proj", "down_proj"):
            tok, experts = (ids == idx[0]).any(1), torch.tensor([idx[0]])
        else:  # topk_weights
            tok, experts = torch.zeros(ids.shape[0], dtype=torch.bool), ids[idx[0], idx[1]].reshape(1)
            tok[idx[0]] = True
        rows = tok[:, None].expand(clean["out"].shape)
        hit_e = torch.zeros(args["gate_up_proj"].shape[0], dtype=torch.bool)
        hit_e[experts] = True
        spec = {"out": (rows, ~rows), "dhidden_states": (None, ~rows),
                "dgate_up_proj": (None, ~hit_e[:, None, None].expand(clean["dgate_up_proj"].shape)),
                "ddown_proj": (None, ~hit_e[:, None, None].expand(clean["ddown_proj"].shape)),
                "dtopk_weights": (None, ~tok[:, None].expand(clean["dtopk_weights"].shape))}
        if name == "topk_weights":
            spec["dtopk_weights"] = (mask_of("dtopk_weights"), None)
        return spec
    if n.startswith("overlong_penalty"):
        hit = only("out", idx)
        return {"out": (hit, ~hit)}
    raise AssertionError(f"no semantics for {n}")


# --------------------------------------------------------------------------- checks
def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a == b) | (a.isnan() & b.isnan()) if a.is_floating_point() else a == b


# Ops whose outputs are fp64 sums that the backends add in another order (Triton in blocks, torch one
# term at a time): their last bits differ by up to ~the number of terms (rollout_correction: <= 40).
_SUM_ORDER_ULPS = {"rollout_correction": 64}
# Outputs formed by cancellation: k3 = exp(lr) - 1 - lr subtracts terms of magnitude >= 1, so the backends'
# exp (1 ulp apart: numpy vs torch) differ in ulps of 1, not of the (tiny) result.
_CANCELLING = {"rollout_correction": "k3"}


def _check_backends_agree(runs: Dict[str, Dict], clean: Dict[str, Dict], what: str) -> None:
    ulps = next((u for op, u in _SUM_ORDER_ULPS.items() if what.startswith(op)), 1)
    a, b = runs["torch"], runs["triton"]
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        if not x.is_floating_point():
            assert torch.equal(x, y), f"{what}: {k} differs between the backends"
            continue
        for test in (torch.isnan, torch.isposinf, torch.isneginf):
            bad = test(x) != test(y)
            assert not bad.any(), (f"{what}: {k} is {test.__name__[2:]} on one backend only, at "
                                   f"{torch.nonzero(bad)[:4].tolist()} (torch {x[bad][:4].tolist()}, "
                                   f"triton {y[bad][:4].tolist()})")
        fin = torch.isfinite(x)
        # Finite entries: as close as the backends are on the clean inputs (their usual rounding).
        clean_diff = (clean["torch"][k].double() - clean["triton"][k].double()).abs().nan_to_num(0.0)
        scale = max(x[fin].abs().max().item() if fin.any() else 0.0, 1e-30)
        if any(what.startswith(op) and part in k for op, part in _CANCELLING.items()):
            scale = max(scale, 1.0)
        bound = 2 * max(clean_diff.max().item() if clean_diff.numel() else 0.0, ulps * eps(x.dtype) * scale)
        err = (x[fin].double() - y[fin].double()).abs().max().item() if fin.any() else 0.0
        assert err <= bound, f"{what}: {k} finite entries differ by {err:.3e} between backends (bound {bound:.3e})"


def _check_semantics(run: Dict, clean: Dict, spec: Spec, is_nan: bool, what: str) -> None:
    for k, (nan_mask, same_mask) in spec.items():
        x = run[k]
        if is_nan and nan_mask is not None:
            wrong = x.isnan() != nan_mask
            assert not wrong.any(), (f"{what}: {k} NaN pattern wrong at {torch.nonzero(wrong)[:4].tolist()} "
                                     f"(got {x[wrong][:4].tolist()}, NaN expected: {nan_mask[wrong][:4].tolist()})")
        if same_mask is not None:
            moved = same_mask & ~_bitwise_equal(x, clean[k])
            assert not moved.any(), (f"{what}: {k} changed where the poisoned input cannot reach, at "
                                     f"{torch.nonzero(moved)[:4].tolist()} ({x[moved][:4].tolist()} vs clean "
                                     f"{clean[k][moved][:4].tolist()})")


@pytest.mark.parametrize("case", _FLOAT_CASES, ids=lambda c: c.name)
def test_nonfinite_inputs_propagate_alike(case):
    args = case.make()
    clean = {be: run_case(case, args, be) for be in BACKENDS}
    placements = _placements(case, args)
    assert placements, f"{case.name}: no float input found"
    for name, idx, where in placements:
        for vname, val in VALUES.items():
            poisoned = args[name].clone()
            poisoned[idx] = val
            what = f"{case.name}: {vname} in {name}{list(idx)} {where}".rstrip()
            runs = {be: run_case(case, {**args, name: poisoned}, be) for be in BACKENDS}
            _check_backends_agree(runs, clean, what)
            spec = _spec(case, args, clean["torch"], name, idx, where)
            # Attention marks what depends on any non-finite input NaN; elsewhere inf may stay inf.
            strict = math.isnan(val) or case.name.startswith("varlen_attention")
            for be in BACKENDS:
                _check_semantics(runs[be], clean[be], spec, strict, f"{what} [{be}]")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_attention_nan_upstream_gradient(causal):
    """A NaN in ``d out`` at one (token, head): NaN ``dq`` there and NaN ``dk`` / ``dv`` for the keys
    that query attends, nothing else, on both backends."""
    case = next(c for c in CASES if c.name == f"varlen_attention-{'causal' if causal else 'full'}")
    args = case.make()
    cu = args["cu_seqlens"].tolist()
    t, h = cu[2] + 5, 1
    hq, hkv = args["q"].shape[1], args["k"].shape[1]
    bad = torch.zeros(args["q"].shape[:2], dtype=torch.bool)
    bad[t, h] = True
    keys = _attended_by(bad.reshape(-1, hkv, hq // hkv).any(-1), cu, causal, keys=True)
    want = {"dq": bad[:, :, None], "dk": keys[:, :, None], "dv": keys[:, :, None]}
    grads, clean = {}, {}
    for be in BACKENDS:
        q, k, v = (args[n].clone().requires_grad_() for n in ("q", "k", "v"))
        with backend(be):
            out = case.call({**args, "q": q, "k": k, "v": v})[0]
            cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
            clean[be] = dict(zip(want, torch.autograd.grad(out, [q, k, v], cot, retain_graph=True)))
            cot[t, h, 3] = float("nan")
            grads[be] = dict(zip(want, torch.autograd.grad(out, [q, k, v], cot)))
        spec = {n: (m.expand(clean[be][n].shape), ~m.expand(clean[be][n].shape)) for n, m in want.items()}
        _check_semantics(grads[be], clean[be], spec, True, f"NaN in d out[{t}, {h}] [{be}]")
    _check_backends_agree(grads, clean, f"NaN in d out[{t}, {h}]")


@pytest.mark.parametrize("name", _INTEGER_ONLY)
def test_integer_only_ops_have_no_float_input(name):
    case = next(c for c in CASES if c.name == name)
    args = case.make()
    floats = [n for n, t in args.items() if isinstance(t, torch.Tensor) and t.is_floating_point()]
    assert not floats, f"{name} has float inputs {floats}: it belongs in the NaN/inf test"
    assert any(isinstance(t, torch.Tensor) for t in args.values())
