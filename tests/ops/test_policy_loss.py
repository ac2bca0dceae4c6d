"""dk.policy_loss against verl-semantics float64 references, both backends."""
import math
from unittest import mock

import pytest
import torch

import dapo_kernels as dk
from dapo_kernels.ops.policy_loss import aggregation_weights
from dapo_kernels.reference import policy_loss_ref
from tests.helpers import assert_no_nan, backend, case_id, cu_seqlens_from
from tests.tolerance import assert_close_to_ref

MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
CLIPS = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)


def log_ratios(n: int) -> torch.Tensor:
    """Mixture: near 0, 2-5% either side of log(0.8), log(1.28), log(3), and beyond +-20."""
    near_bound = torch.tensor([math.log(0.8), math.log(1.28), math.log(3.0)])[torch.randint(0, 3, (n,))]
    side = torch.where(torch.rand(n) < 0.5, -1.0, 1.0)
    kinds = torch.randint(0, 4, (n,))
    return torch.where(kinds == 0, torch.randn(n) * 0.05,
                       torch.where(kinds == 3, side * (20.5 + 10 * torch.rand(n)),
                                   near_bound + side * (0.02 + 0.03 * torch.rand(n))))


def make_inputs(shape, dtype, *, masked_row=True):
    n = math.prod(shape)
    lp = -3 * torch.rand(n)
    old = lp - log_ratios(n)
    adv = torch.randn(n) * (torch.rand(n) > 0.1)  # some exact zeros
    mask = torch.rand(n) > 0.25
    lp, old, adv, mask = (t.reshape(shape) for t in (lp, old, adv, mask))
    if masked_row and len(shape) == 2 and shape[0] > 1:
        mask[1] = False
    return lp.to(dtype), old.to(dtype), adv.to(dtype), mask


def run_both(lp, old, adv, mask, be, **kw):
    """(loss, metrics, grad) from dk; (loss, metrics, grad) from the reference in float64 and in lp's dtype."""
    x = lp.clone().requires_grad_()
    with backend(be):
        loss, metrics = dk.policy_loss(x, old, adv, mask, **CLIPS, **kw)
        (grad,) = torch.autograd.grad(loss, x)
    refs = []
    for dt in (torch.float64, lp.dtype):
        r = lp.to(dt).requires_grad_()
        rl, rm = policy_loss_ref(r, old.to(dt), adv.to(dt), mask, **CLIPS, **kw)
        refs.append((rl, rm, torch.autograd.grad(rl, r)[0] if rl.requires_grad else torch.zeros_like(r)))
    return (loss, metrics, grad), refs[0], refs[1]


def check(ours, ref64, ref_dt):
    loss, metrics, grad = ours
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert_close_to_ref(loss, ref64[0], ref_dt[0], name="loss")
    assert_close_to_ref(grad, ref64[2], ref_dt[2], name="grad")
    for k in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
        assert not metrics[k].requires_grad and metrics[k].dim() == 0
        assert_close_to_ref(metrics[k], ref64[1][k], ref_dt[1][k], name=k)


@pytest.mark.parametrize("be", ["torch", "triton"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("B,T,dtype", [pytest.param(*c, id=case_id(B=c[0], T=c[1], dtype=c[2])) for c in
                                       [(3, 37, torch.float32), (1, 1, torch.float32), (4, 70, torch.bfloat16)]])
def test_padded_matches_reference(be, mode, B, T, dtype):
    lp, old, adv, mask = make_inputs((B, T), dtype)
    check(*run_both(lp, old, adv, mask, be, loss_agg_mode=mode))


@pytest.mark.parametrize("be", ["torch", "triton"])
@pytest.mark.parametrize("mode", MODES)
def test_packed_matches_reference(be, mode):
    lengths = [5, 0, 1, 40, 13]
    cu = cu_seqlens_from(lengths)
    lp, old, adv, mask = make_inputs((sum(lengths),), torch.float32)
    mask[45:58] = False  # the last sequence is fully masked
    kw = dict(loss_agg_mode=mode, cu_seqlens=cu if mode.startswith("seq") else None)
    check(*run_both(lp, old, adv, mask, be, **kw))


@pytest.mark.parametrize("be", ["torch", "triton"])
@pytest.mark.parametrize("mode", MODES)
def test_all_masked_gives_zero_loss_and_grad(be, mode):
    lp, old, adv, _ = make_inputs((2, 9), torch.float32)
    x = lp.requires_grad_()
    with backend(be):
        loss, metrics = dk.policy_loss(x, old, adv, torch.zeros(2, 9, dtype=torch.bool), loss_agg_mode=mode)
        loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(x.grad, torch.zeros_like(x))
    assert all(v.item() == 0.0 for v in metrics.values())


@pytest.mark.parametrize("be", ["torch", "triton"])
@pytest.mark.parametrize("mode,count_kw", [("token-mean", "num_tokens"), ("seq-mean-token-mean", "num_seqs")])
def test_global_counts_make_micro_batches_exact(be, mode, count_kw):
    """Summing micro-batch losses normalised by the global count == the full-batch loss."""
    lp, old, adv, mask = make_inputs((6, 21), torch.float32, masked_row=False)
    with backend(be):
        full, _ = dk.policy_loss(lp, old, adv, mask, loss_agg_mode=mode)
        total = mask.sum() if count_kw == "num_tokens" else torch.tensor(6)
        parts = [dk.policy_loss(lp[s], old[s], adv[s], mask[s], loss_agg_mode=mode, **{count_kw: total})[0]
                 for s in (slice(0, 2), slice(2, 6))]
    ref, _ = policy_loss_ref(lp.double(), old.double(), adv.double(), mask, loss_agg_mode=mode)
    assert_close_to_ref(full, ref, policy_loss_ref(lp, old, adv, mask, loss_agg_mode=mode)[0], name="full")
    # Plain torch's own error for the same sum: fp32 micro-batch losses (which may cancel) added.
    torch_parts = [policy_loss_ref(lp[s], old[s], adv[s], mask[s], loss_agg_mode=mode, **{count_kw: total})[0]
                   for s in (slice(0, 2), slice(2, 6))]
    assert_close_to_ref(parts[0] + parts[1], ref, torch_parts[0] + torch_parts[1], name="sum of micro-batches")


@pytest.mark.parametrize("be", ["torch", "triton"])
def test_empty_input(be):
    z = torch.zeros(0)
    with backend(be):
        loss, metrics = dk.policy_loss(z, z, z, torch.zeros(0, dtype=torch.bool))
    assert loss.item() == 0.0 and all(v.item() == 0.0 for v in metrics.values())


def test_integer_mask_equals_bool_mask():
    lp, old, adv, mask = make_inputs((2, 11), torch.float32)
    a, _ = dk.policy_loss(lp, old, adv, mask)
    b, _ = dk.policy_loss(lp, old, adv, mask.long())
    assert_no_nan(a)
    assert torch.equal(a, b)


@pytest.mark.parametrize("case,exc,kw", [
    ("shape-mismatch", ValueError, dict(old_log_prob=torch.zeros(2, 4))),
    ("complex-mask", ValueError, dict(response_mask=torch.ones(2, 3, dtype=torch.complex64))),
    ("int-log-prob", ValueError, dict(log_prob=torch.zeros(2, 3, dtype=torch.long))),
    ("not-a-tensor", TypeError, dict(advantages=[0.0, 1.0])),
    ("bad-mode", ValueError, dict(loss_agg_mode="seq-mean")),
    ("clip-c-le-1", ValueError, dict(clip_ratio_c=1.0)),
    ("clip-low-ge-1", ValueError, dict(clip_ratio_low=1.0)),
    ("cu-seqlens-with-2d", ValueError, dict(cu_seqlens=torch.tensor([0, 6], dtype=torch.int32))),
    ("negative-num-tokens", ValueError, dict(num_tokens=-1)),
    # NaN / inf / 0 where the loss would be NaN or ~1e30: rejected before any kernel runs.
    ("nan-clip-high", ValueError, dict(clip_ratio_high=math.nan)),
    ("nan-clip-c", ValueError, dict(clip_ratio_c=math.nan)),
    ("nan-num-tokens", ValueError, dict(num_tokens=math.nan)),
    ("inf-num-tokens", ValueError, dict(num_tokens=math.inf)),
    ("nan-num-seqs", ValueError, dict(num_seqs=math.nan, loss_agg_mode="seq-mean-token-mean")),
    ("zero-loss-scale", ValueError, dict(loss_scale_factor=0, loss_agg_mode="seq-mean-token-sum-norm")),
    ("zero-loss-scale-unused-mode", ValueError, dict(loss_scale_factor=0.0)),
    ("bool-tensor-num-tokens", TypeError, dict(num_tokens=torch.tensor(True))),
])
def test_bad_input(case, exc, kw):
    args = dict(log_prob=torch.zeros(2, 3), old_log_prob=torch.zeros(2, 3), advantages=torch.zeros(2, 3),
                response_mask=torch.ones(2, 3, dtype=torch.bool))
    pos = {k: kw.pop(k) for k in list(kw) if k in args}
    args.update(pos)
    with pytest.raises(exc, match=next(iter(pos), None) or next(iter(kw))):
        dk.policy_loss(*args.values(), **kw)


@pytest.mark.parametrize("be", ["torch", "triton"])
@pytest.mark.parametrize("name,value,mode", [
    ("num_tokens", torch.tensor(-5.0), "token-mean"),
    ("num_tokens", torch.tensor([math.nan]), "token-mean"),
    ("num_tokens", torch.tensor(-1), "token-mean"),
    ("num_seqs", torch.tensor(math.inf), "seq-mean-token-sum"),
    ("loss_scale_factor", torch.tensor(0.0), "seq-mean-token-sum-norm"),
    ("loss_scale_factor", torch.tensor(-2.0), "seq-mean-token-sum-norm"),
])
def test_bad_tensor_count_asserted_on_device(be, name, value, mode):
    """Tensor counts are checked by a device-side assert (no host sync): on the CPU it raises at once."""
    lp, old, adv, mask = make_inputs((2, 5), torch.float32)
    with backend(be), pytest.raises(RuntimeError, match=f"{name} must be finite and"):
        dk.policy_loss(lp, old, adv, mask, loss_agg_mode=mode, **{name: value})


def test_tensor_count_check_reads_no_value():
    """The device-side count check must not read the tensor on the host (that would sync on a GPU)."""
    lp, old, adv, mask = make_inputs((2, 5), torch.float32)
    reads = ("item", "tolist", "__bool__", "__int__", "__float__")
    with mock.patch.multiple(torch.Tensor, **{r: mock.Mock(side_effect=AssertionError(r)) for r in reads}):
        loss, _ = dk.policy_loss(lp, old, adv, mask, num_tokens=torch.tensor(7))
        w = aggregation_weights(mask, "seq-mean-token-sum-norm", num_seqs=torch.tensor(2),
                                loss_scale_factor=torch.tensor(3.0))
    assert loss.isfinite() and w.isfinite().all()


@pytest.mark.parametrize("be", ["torch", "triton"])
def test_tensor_counts_equal_number_counts(be):
    lp, old, adv, mask = make_inputs((3, 7), torch.float32)
    with backend(be):
        for mode, kw in (("token-mean", dict(num_tokens=30)), ("seq-mean-token-mean", dict(num_seqs=5)),
                         ("seq-mean-token-sum-norm", dict(loss_scale_factor=2.5))):
            as_number, _ = dk.policy_loss(lp, old, adv, mask, loss_agg_mode=mode, **kw)
            as_tensor, _ = dk.policy_loss(lp, old, adv, mask, loss_agg_mode=mode,
                                          **{k: torch.tensor(v) for k, v in kw.items()})
            assert torch.equal(as_number, as_tensor), (mode, kw)


def test_packed_seq_mode_needs_cu_seqlens():
    z = torch.zeros(5)
    with pytest.raises(ValueError, match="cu_seqlens"):
        dk.policy_loss(z, z, z, torch.ones(5, dtype=torch.bool), loss_agg_mode="seq-mean-token-sum")


@pytest.mark.parametrize("count", ["num_tokens", "num_seqs"])
def test_zero_global_count_with_selected_tokens_is_refused(count):
    """A count of 0 with a non-empty mask would turn the mean into a sum: a Python 0 raises naming
    the argument, a tensor 0 (no host read) gives a NaN loss; with an empty mask both give 0."""
    lp, old, adv = torch.randn(2, 5), torch.randn(2, 5), torch.randn(2, 5)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mode = "token-mean" if count == "num_tokens" else "seq-mean-token-mean"
    with pytest.raises(ValueError, match=count):
        dk.policy_loss(lp, old, adv, mask, loss_agg_mode=mode, **{count: 0})
    loss = dk.policy_loss(lp, old, adv, mask, loss_agg_mode=mode, **{count: torch.zeros(())})[0]
    assert torch.isnan(loss)
    empty = torch.zeros_like(mask)
    for zero in (0, torch.zeros(())):
        assert dk.policy_loss(lp, old, adv, empty, loss_agg_mode=mode, **{count: zero})[0] == 0


# --------------------------------------------------------------------------- rollout IS weights
def is_weights(shape, dtype, seed=1):
    """Truncated-IS-like weights in [0.1, 2], a few exact 0 (rejected) and 1, in ``dtype`` (fixed seed)."""
    g = torch.Generator().manual_seed(seed)
    r = 0.1 + 1.9 * torch.rand(shape, generator=g)
    kind = torch.randint(0, 8, shape, generator=g)
    return torch.where(kind == 0, 0.0, torch.where(kind == 1, 1.0, r)).to(dtype)


def run_both_weighted(lp, old, adv, mask, r, be, **kw):
    """run_both with ``rollout_is_weights``: ``r`` in fp64 for the float64 reference, as given for the other."""
    x, rw = lp.clone().requires_grad_(), r.clone().requires_grad_()
    with backend(be):
        loss, metrics = dk.policy_loss(x, old, adv, mask, **CLIPS, rollout_is_weights=rw, **kw)
        grad, g_r = torch.autograd.grad(loss, [x, rw], allow_unused=True)
    assert g_r is None, "rollout_is_weights are constants: no gradient"
    refs = []
    for dt in (torch.float64, lp.dtype):
        t = lp.to(dt).requires_grad_()
        rl, rm = policy_loss_ref(t, old.to(dt), adv.to(dt), mask, **CLIPS, rollout_is_weights=r.to(dt), **kw)
        refs.append((rl, rm, torch.autograd.grad(rl, t)[0] if rl.requires_grad else torch.zeros_like(t)))
    return (loss, metrics, grad), refs[0], refs[1]


@pytest.mark.parametrize("be", ["torch", "triton"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", ["padded-fp32", "padded-bf16", "packed"])
def test_rollout_is_weights_match_reference(be, mode, layout):
    """Each token's loss times its IS weight before the aggregation (verl's pg_losses * rollout_is_weights):
    loss, gradient and (unweighted) metrics within the tolerance rule; the weights get no gradient."""
    torch.manual_seed(0)
    kw = dict(loss_agg_mode=mode)
    if layout == "packed":
        lengths = [5, 0, 1, 40, 13]
        lp, old, adv, mask = make_inputs((sum(lengths),), torch.float32)
        kw["cu_seqlens"] = cu_seqlens_from(lengths) if mode.startswith("seq") else None
    else:
        lp, old, adv, mask = make_inputs((4, 70), torch.bfloat16 if layout.endswith("bf16") else torch.float32)
    check(*run_both_weighted(lp, old, adv, mask, is_weights(lp.shape, lp.dtype), be, **kw))


@pytest.mark.parametrize("be", ["torch", "triton"])
@pytest.mark.parametrize("mode", MODES)
def test_all_ones_is_weights_are_bit_identical(be, mode):
    """rollout_is_weights of ones gives the bits of no weights (loss, metrics and gradient)."""
    torch.manual_seed(0)
    lengths = [5, 0, 1, 40, 13]
    lp, old, adv, mask = make_inputs((sum(lengths),), torch.float32)
    kw = dict(loss_agg_mode=mode, cu_seqlens=cu_seqlens_from(lengths) if mode.startswith("seq") else None)
    outs = []
    for r in (None, torch.ones_like(lp)):
        x = lp.clone().requires_grad_()
        with backend(be):
            loss, metrics = dk.policy_loss(x, old, adv, mask, rollout_is_weights=r, **kw)
            outs.append((loss, metrics, torch.autograd.grad(loss, x)[0]))
    (a, ma, ga), (b, mb, gb) = outs
    assert torch.equal(a, b) and torch.equal(ga, gb) and all(torch.equal(ma[k], mb[k]) for k in ma)


@pytest.mark.parametrize("be", ["torch", "triton"])
def test_nan_is_weight_reaches_only_its_token(be):
    """A NaN weight on a selected token: NaN loss, NaN gradient at that token only, metrics unchanged; on a
    token the mask selects away: the bits of the clean weights."""
    torch.manual_seed(0)
    lp, old, adv, mask = make_inputs((3, 17), torch.float32)
    adv[adv == 0] = 0.5  # a zero advantage would give the poisoned token a zero gradient (NaN * 0 is kept NaN)
    r = is_weights(lp.shape, torch.float32)

    def run(weights):
        x = lp.clone().requires_grad_()
        with backend(be):
            loss, metrics = dk.policy_loss(x, old, adv, mask, rollout_is_weights=weights)
            return loss, metrics, torch.autograd.grad(loss, x)[0]

    clean = run(r)
    for where in (mask, ~mask):
        i = tuple(torch.nonzero(where)[0].tolist())
        bad = r.clone()
        bad[i] = math.nan
        loss, metrics, grad = run(bad)
        others = torch.ones_like(mask)
        others[i] = False
        assert torch.equal(grad[others], clean[2][others])
        assert all(torch.equal(metrics[k], clean[1][k]) for k in metrics)
        if where is mask:
            assert loss.isnan() and grad[i].isnan()
        else:
            assert torch.equal(loss, clean[0]) and torch.equal(grad, clean[2])


@pytest.mark.parametrize("case,exc,value", [
    ("wrong-shape", ValueError, torch.ones(3, 2)),
    ("int-dtype", ValueError, torch.ones(2, 3, dtype=torch.long)),
    ("bool-dtype", ValueError, torch.ones(2, 3, dtype=torch.bool)),
    ("other-device", ValueError, torch.ones(2, 3, device="meta")),
    ("flat", ValueError, torch.ones(6)),
    ("not-a-tensor", TypeError, [[1.0] * 3] * 2),
])
def test_bad_is_weights_name_the_argument(case, exc, value):
    z = torch.zeros(2, 3)
    with pytest.raises(exc, match="rollout_is_weights"):
        dk.policy_loss(z, z, z, torch.ones(2, 3, dtype=torch.bool), rollout_is_weights=value)


def test_is_weights_are_not_read_on_the_host():
    """Negative and non-finite weights are not checked: no host read of their values (a GPU sync)."""
    lp, old, adv, mask = make_inputs((2, 5), torch.float32)
    r = torch.full((2, 5), -1.0)
    reads = ("item", "tolist", "__bool__", "__int__", "__float__")
    with mock.patch.multiple(torch.Tensor, **{n: mock.Mock(side_effect=AssertionError(n)) for n in reads}):
        neg, _ = dk.policy_loss(lp, old, adv, mask, rollout_is_weights=r)
        plain, _ = dk.policy_loss(lp, old, adv, mask)
    assert torch.equal(neg, -plain)
