"""dk.rollout_correction against its float64 reference (verl 0.9.1's semantics), both backends, packed
and padded; verl itself: tests/test_verl_rollout_correction.py."""
import math

import pytest
import torch

import dapo_kernels as dk
from dapo_kernels.reference import rollout_correction_ref
from tests.helpers import assert_equal, backend, cu_seqlens_from
from tests.sync_counter import count_host_syncs
from tests.tolerance import assert_close_to_ref

ALL_RS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
          "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
# A bound per option that rejects some of make_batch's tokens / sequences and keeps others.
RS_BOUND = {"token_k1": "0.7_1.4", "token_k2": "0.05", "token_k3": "0.05", "seq_sum_k1": "0.2_5",
            "seq_sum_k2": "1.5", "seq_sum_k3": "1.5", "seq_mean_k1": "0.9_1.1", "seq_mean_k2": "0.03",
            "seq_mean_k3": "0.03", "seq_max_k2": "0.3", "seq_max_k3": "0.3"}
IS_MODES = [dict(rollout_is=level, rollout_is_threshold=thr, rollout_is_batch_normalize=norm)
            for level, thresholds in (("token", (2.0, "0.5_2.0")), ("sequence", ("5", "0.2_5.0")))
            for thr in thresholds for norm in (False, True)]
RS_MODES = [dict(rollout_rs=opt, rollout_rs_threshold=RS_BOUND[opt]) for opt in ALL_RS] + [
    dict(rollout_rs="token_k1", rollout_rs_threshold=1.4),  # k1 with an upper bound only: [1/1.4, 1.4]
    dict(rollout_rs=",".join(ALL_RS), rollout_rs_threshold=",".join(RS_BOUND[o] for o in ALL_RS)),
    dict(rollout_rs="token_k2, seq_mean_k3,token_k2", rollout_rs_threshold=0.3),  # one bound for all, deduplicated
]
MODES = IS_MODES + RS_MODES + [
    dict(rollout_is="token", rollout_is_threshold="0.5_2", rollout_rs="token_k1,seq_max_k3",
         rollout_rs_threshold="0.6_1.6,0.4"),
    dict(rollout_is="sequence", rollout_is_batch_normalize=True, rollout_rs="seq_mean_k1",
         rollout_rs_threshold="0.95_1.05"),
]


def mode_id(m: dict) -> str:
    return "-".join(f"{k.replace('rollout_', '')}={v}" for k, v in m.items()).replace(",", "+")


def make_batch(B=7, L=41, dtype=torch.float32, *, gen=None, empty_row=True):
    """Padded (old, rollout, mask): log-ratios mostly within +-0.15, some +-1.5, 1% beyond +-20; one empty row."""
    g = gen or torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    old = -3 * torch.rand(B, L, generator=g, dtype=torch.float64)
    kind = torch.rand(B, L, generator=g)
    lr = torch.where(kind < 0.8, 0.05, torch.where(kind < 0.99, 0.5, 25.0)) * torch.randn(B, L, generator=g,
                                                                                           dtype=torch.float64)
    lr = lr * min(1.0, (41 / L) ** 0.5)  # sequence sums of long rows as spread as those of 41 tokens
    mask = torch.rand(B, L, generator=g) > 0.25
    if empty_row:
        mask[2] = False
    return old.to(dtype), (old - lr).to(dtype), mask


def run(be, *args, **kw):
    with backend(be):
        return dk.rollout_correction(*args, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("be", ["torch", "triton"])
@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_matches_fp64_reference(mode, be, dtype):
    """Weights and metrics within the tolerance rule of the fp64 reference (plain torch in the input dtype
    is the comparator), the mask exactly the reference's, verl's metric keys all there."""
    old, roll, mask = make_batch(dtype=dtype)
    out = run(be, old, roll, mask, **mode)
    w64, m64, met64 = rollout_correction_ref(old.double(), roll.double(), mask, **mode)
    w_lo, _, met_lo = rollout_correction_ref(old, roll, mask, **mode)
    assert_equal(out.response_mask, m64, "response_mask")
    assert (out.rollout_is_weights is None) == (w64 is None)
    if w64 is not None:
        assert out.rollout_is_weights.dtype == dtype
        assert_close_to_ref(out.rollout_is_weights, w64, w_lo, name="rollout_is_weights")
    assert list(out.metrics) == list(met64), "metric keys or their order differ from the reference"
    for k, v in out.metrics.items():
        assert v.dtype == torch.float64 and v.shape == ()
        assert_close_to_ref(v, met64[k], met_lo[k], name=k)


@pytest.mark.parametrize("be", ["torch", "triton"])
@pytest.mark.parametrize("mode", [MODES[1], MODES[6], MODES[-4], MODES[-2], MODES[-1]], ids=mode_id)
def test_packed_equals_padded(mode, be):
    """Packed tokens with cu_seqlens give bitwise the padded batch's weights, mask and metrics
    (lengths 0 to 300: several of the kernel's 256-token steps)."""
    g = torch.Generator().manual_seed(5)
    lens = [300, 0, 1, 37, 256, 129]
    old, roll, mask = make_batch(len(lens), max(lens), gen=g, empty_row=False)
    inside = torch.stack([torch.arange(max(lens)) < n for n in lens])
    mask &= inside
    padded = run(be, old, roll, mask, **mode)
    packed = run(be, old[inside], roll[inside], mask[inside], cu_seqlens=cu_seqlens_from(lens), **mode)
    assert_equal(packed.response_mask, padded.response_mask[inside], "response_mask")
    if padded.rollout_is_weights is not None:
        assert_equal(packed.rollout_is_weights, padded.rollout_is_weights[inside], "rollout_is_weights")
        assert_equal(padded.rollout_is_weights[~inside], torch.zeros((~inside).sum().item()), "padding weights")
    assert packed.metrics.keys() == padded.metrics.keys()
    for k in padded.metrics:
        assert_equal(packed.metrics[k], padded.metrics[k], k)


def _agree(a, b, what):
    """Same NaN / +-inf pattern; finite values within 1e-12 relative (fp64 sums in another order)."""
    for k in a:
        x, y = a[k].double(), b[k].double()
        for test in (torch.isnan, torch.isposinf, torch.isneginf):
            assert torch.equal(test(x), test(y)), f"{what}: {k} {test.__name__} differs ({x} vs {y})"
        fin = torch.isfinite(x)
        assert torch.allclose(x[fin], y[fin], rtol=1e-12, atol=1e-300), f"{what}: {k}: {x} vs {y}"


def _flat(r):
    out = {"mask": r.response_mask, **r.metrics}
    if r.rollout_is_weights is not None:
        out["weights"] = r.rollout_is_weights
    return out


@pytest.mark.parametrize("mode", [MODES[-3], MODES[-1]], ids=mode_id)
def test_backends_agree_with_nonfinite_inputs(mode):
    """NaN / +-inf in either log-prob, at a token the mask selects and at one it drops: both backends give
    the same NaN / inf entries and the same finite ones; a dropped token changes nothing at all."""
    old, roll, mask = make_batch(dtype=torch.float64)
    clean = {be: _flat(run(be, old, roll, mask, **mode)) for be in ("torch", "triton")}
    _agree(clean["torch"], clean["triton"], "clean")
    for which in (0, 1):
        for where, sel in (("selected", mask), ("dropped", ~mask)):
            pos = tuple(torch.nonzero(sel)[3].tolist())
            for val in (math.nan, math.inf, -math.inf):
                args = [old.clone(), roll.clone()]
                args[which][pos] = val
                runs = {be: _flat(run(be, *args, mask, **mode)) for be in ("torch", "triton")}
                what = f"{val} in {('old', 'rollout')[which]}{list(pos)} ({where})"
                _agree(runs["torch"], runs["triton"], what)
                if where == "dropped":
                    for be in runs:
                        for k in runs[be]:
                            assert torch.equal(runs[be][k], clean[be][k]), f"{what} [{be}]: {k} changed"
                elif math.isnan(val) and "weights" in runs["torch"]:
                    w = runs["torch"]["weights"]
                    seq = mode.get("rollout_is") == "sequence"
                    want = torch.zeros_like(mask)
                    want[pos[0]] = mask[pos[0]] if seq else want[pos[0]]
                    want[pos] = True
                    assert torch.equal(w.isnan(), want), f"{what}: NaN weights not exactly the poisoned " + (
                        "sequence's tokens" if seq else "token")


def test_mask_dtype_kept_and_float_mask_checked():
    """The returned mask has the input mask's dtype (verl: bool, int64 or float 0 / 1); a float mask
    holding anything but 0 / 1 is refused on the device."""
    old, roll, mask = make_batch()
    for dt in (torch.bool, torch.int64, torch.float32, torch.float64):
        out = dk.rollout_correction(old, roll, mask.to(dt), rollout_rs="token_k2", rollout_rs_threshold=0.05)
        assert out.response_mask.dtype == dt
        assert torch.equal(out.response_mask != 0, out.response_mask.bool() & mask)
    with pytest.raises(RuntimeError, match="response_mask"):
        dk.rollout_correction(old, roll, mask.float() * 0.5)


BAD_OPTIONS = [
    (dict(rollout_is="tokens"), "rollout_is"),
    (dict(rollout_is="token", rollout_is_threshold="abc"), "rollout_is_threshold"),
    (dict(rollout_is="token", rollout_is_threshold=""), "rollout_is_threshold"),
    (dict(rollout_is="token", rollout_is_threshold=-1.0), "rollout_is_threshold"),
    (dict(rollout_is="token", rollout_is_threshold="2_1"), "rollout_is_threshold"),
    (dict(rollout_is="sequence", rollout_is_threshold="0_1"), "rollout_is_threshold"),
    (dict(rollout_is="token", rollout_is_threshold="nan"), "rollout_is_threshold"),
    (dict(rollout_rs="token_k4", rollout_rs_threshold=1.0), "rollout_rs"),
    (dict(rollout_rs=" , ", rollout_rs_threshold=1.0), "rollout_rs"),
    (dict(rollout_rs="token_k1"), "rollout_rs_threshold"),
    (dict(rollout_rs="token_k1,seq_sum_k2", rollout_rs_threshold="1,2,3"), "rollout_rs_threshold"),
    (dict(rollout_rs="token_k2", rollout_rs_threshold="0.5_2"), "rollout_rs_threshold"),
    (dict(rollout_rs="seq_max_k3", rollout_rs_threshold="0"), "rollout_rs_threshold"),
    (dict(rollout_rs="seq_sum_k1", rollout_rs_threshold="2_0.5"), "rollout_rs_threshold"),
    (dict(rollout_rs="token_k1", rollout_rs_threshold="x_2"), "rollout_rs_threshold"),
    (dict(rollout_rs=3), "rollout_rs"),
]


@pytest.mark.parametrize("kw,name", BAD_OPTIONS, ids=[f"{n}-{i}" for i, (_, n) in enumerate(BAD_OPTIONS)])
def test_bad_options_raise_value_error_naming_the_argument(kw, name):
    """Each bad mode or threshold spec: ValueError whose message names the argument."""
    old, roll, mask = make_batch(3, 5)
    with pytest.raises(ValueError, match=name):
        dk.rollout_correction(old, roll, mask, **kw)


def test_bad_inputs():
    """Shapes / packing mistakes are ValueErrors, wrong types TypeErrors (verl's rule for a bool threshold)."""
    old, roll, mask = make_batch(3, 5)
    with pytest.raises(TypeError, match="rollout_is_threshold"):
        dk.rollout_correction(old, roll, mask, rollout_is="token", rollout_is_threshold=True)
    with pytest.raises(ValueError, match="rollout_log_prob"):
        dk.rollout_correction(old, roll[:, :4], mask)
    with pytest.raises(ValueError, match="cu_seqlens"):
        dk.rollout_correction(old.reshape(-1), roll.reshape(-1), mask.reshape(-1))
    with pytest.raises(ValueError, match="cu_seqlens"):
        dk.rollout_correction(old, roll, mask, cu_seqlens=cu_seqlens_from([5, 5, 5]))
    with pytest.raises(ValueError, match="at least one token"):
        dk.rollout_correction(old[:0], roll[:0], mask[:0])


@pytest.mark.parametrize("mode", [MODES[3], MODES[-4], MODES[-2]], ids=mode_id)
def test_no_host_reads_on_the_triton_path(mode):
    """Padded: no tensor value reaches the host. Packed: one read, the check of a new cu_seqlens tensor."""
    old, roll, mask = make_batch()
    with backend("triton"), count_host_syncs() as c:
        dk.rollout_correction(old, roll, mask, **mode)
    assert c.count == 0, c.report()
    lens = [41] * 7
    cu = cu_seqlens_from(lens)
    flat = [t.reshape(-1) for t in (old, roll, mask)]
    for expected in (1, 0):  # the second call reuses the checked tensor
        with backend("triton"), count_host_syncs() as c:
            dk.rollout_correction(*flat, cu_seqlens=cu, **mode)
        assert c.count == expected, c.report()


def test_all_masked_batch_is_not_refused():
    """verl raises on an all-masked batch (a host read); here: weights 0, the mask unchanged, the same on
    both backends."""
    old, roll, mask = make_batch()
    mask[:] = False
    outs = {be: run(be, old, roll, mask, **MODES[-2]) for be in ("torch", "triton")}
    for o in outs.values():
        assert not o.rollout_is_weights.any() and not o.response_mask.any()
    _agree(_flat(outs["torch"]), _flat(outs["triton"]), "all masked")
