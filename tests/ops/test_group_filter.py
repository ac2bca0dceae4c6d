"""group_filter against verl's semantics written plainly, both backends.

The reference (dapo_kernels.reference.group_filter) groups with a Python dict, decides
the keep rule with ``np.std`` and computes advantages with ``torch.std`` per group, in
float64; run in float32 it is "what plain torch costs in float32", the tolerance bound.
Keep decisions, group sizes and counts must match exactly.
"""
import numpy as np
import pytest
import torch

import dapo_kernels as dk
from dapo_kernels.reference import group_filter_ref
from tests.helpers import assert_equal, backend, case_id
from tests.tolerance import assert_close_to_ref

EPS = 1e-6


def make_scores(sizes, kind: str, dtype=torch.float32, *, shuffle=True):
    """Scores and group_index for groups of the given sizes (0 = empty group).

    kind: 'binary' (0/1 accuracy), 'continuous' (randn), 'mixed' (a third of the groups
    all-equal at a value whose mean rounds, the rest binary or continuous).
    """
    gi = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes, dtype=torch.int64))
    N = gi.numel()
    if kind == "binary":
        s = torch.randint(0, 2, (N,)).double()
    elif kind == "continuous":
        s = torch.randn(N, dtype=torch.float64)
    else:
        s = torch.where(torch.rand(N) < 0.5, torch.randint(0, 2, (N,)).double(), torch.randn(N, dtype=torch.float64))
        uniform = (torch.arange(len(sizes)) % 3 == 0)[gi]
        s = torch.where(uniform, torch.tensor([0.1, 0.7, -1.0, 1.0])[gi % 4].double(), s)
    if shuffle:
        perm = torch.randperm(N)
        s, gi = s[perm], gi[perm]
    return s.to(dtype), gi


def check_against_ref(res, scores, gi, G, *, norm=True, min_std=0.0):
    keep, adv, gkeep, gsize, gmean, gstd = group_filter_ref(scores, gi, G, epsilon=EPS, norm_adv_by_std=norm,
                                                            min_std=min_std)
    keep32, adv32, _, _, gmean32, gstd32 = group_filter_ref(scores, gi, G, epsilon=EPS, norm_adv_by_std=norm,
                                                            min_std=min_std, dtype=torch.float32)
    assert_equal(res.group_size, gsize, "group_size")
    assert_equal(res.group_keep, gkeep, "group_keep")
    assert_equal(res.keep, keep, "keep")
    assert res.num_kept_groups.dtype == torch.int64 and res.num_kept_groups.dim() == 0
    assert int(res.num_kept_groups) == int(gkeep.sum())
    assert int(res.num_invalid) == 0 and int(res.num_out_of_range) == 0
    assert res.advantages.dtype == torch.float32
    assert_close_to_ref(res.advantages, adv, adv32, name="advantages")
    assert_close_to_ref(res.group_mean, gmean, gmean32, name="group_mean")
    assert_close_to_ref(res.group_std, gstd, gstd32, name="group_std")


def random_sizes(G: int, max_size: int = 64, *, empty=False):
    sizes = torch.randint(1, max_size + 1, (G,))
    if empty and G > 2:
        sizes[torch.randperm(G)[: G // 5 + 1]] = 0
    return sizes.tolist()


# ----------------------------------------------------------------------------- index layout
TORCH_CASES = [(G, kind, dt) for G in (1, 7, 300) for kind in ("binary", "continuous", "mixed")
               for dt in (torch.float32,)]
TORCH_CASES += [(40, "mixed", torch.bfloat16), (40, "continuous", torch.float16), (40, "mixed", torch.float64),
                (3100, "mixed", torch.float32)]  # ~100,000 responses


@pytest.mark.parametrize("G,kind,dtype", TORCH_CASES, ids=[case_id(G=G, kind=k, dtype=d) for G, k, d in TORCH_CASES])
def test_index_layout_torch(G, kind, dtype):
    scores, gi = make_scores(random_sizes(G, empty=True), kind, dtype)
    with backend("torch"):
        res = dk.group_filter(scores, gi, G)
    check_against_ref(res, scores, gi, G)


TRITON_CASES = [(G, kind, dt) for G, kind, dt in [
    (1, "binary", torch.float32), (5, "continuous", torch.float32), (37, "mixed", torch.float32),
    (37, "mixed", torch.bfloat16), (23, "continuous", torch.float64)]]


@pytest.mark.parametrize("G,kind,dtype", TRITON_CASES, ids=[case_id(G=G, kind=k, dtype=d) for G, k, d in TRITON_CASES])
def test_index_layout_triton(G, kind, dtype):
    scores, gi = make_scores(random_sizes(G, empty=True), kind, dtype)
    with backend("triton"):
        res = dk.group_filter(scores, gi.to(torch.int32), G)
    check_against_ref(res, scores, gi, G)


@pytest.mark.parametrize("be", ["torch", "triton"])
@pytest.mark.parametrize("norm,min_std", [(False, 0.0), (True, 0.3)], ids=["drgrpo", "minstd0.3"])
def test_options(be, norm, min_std):
    scores, gi = make_scores(random_sizes(29, 16), "continuous")
    with backend(be):
        res = dk.group_filter(scores, gi, 29, norm_adv_by_std=norm, min_std=min_std)
    check_against_ref(res, scores, gi, 29, norm=norm, min_std=min_std)


# ----------------------------------------------------------------------------- contiguous layout
CONTIG = [("torch", 1, 9), ("torch", 16, 512), ("torch", 5, 2000), ("triton", 1, 7), ("triton", 16, 70),
          ("triton", 5, 13), ("triton", 64, 9), ("triton", 4099, 2)]  # 4099: wider than one tile


@pytest.mark.parametrize("be,n,G", CONTIG, ids=[case_id(be=b, n=n, G=G) for b, n, G in CONTIG])
def test_group_size_shortcut(be, n, G):
    scores, gi = make_scores([n] * G, "mixed", shuffle=False)
    with backend(be):
        res = dk.group_filter(scores, group_size=n)
    check_against_ref(res, scores, gi, G)


# ----------------------------------------------------------------------------- awkward cases
@pytest.mark.parametrize("be", ["torch", "triton"])
@pytest.mark.parametrize("layout", ["index", "contig"])
def test_identical_values_have_std_exactly_zero(be, layout):
    # np.std rounds to a nonzero value here, so verl would keep these groups.
    vals, n = [0.1, 0.7, 0.1 + 2**-50], 7
    assert all(np.std([v] * n) > 0 for v in vals)
    scores = torch.tensor(vals, dtype=torch.float64).repeat_interleave(n)
    scores = torch.cat([scores, torch.tensor([-0.0, 0.0] * 3 + [0.0])])  # -0.0 == 0.0: one value
    G = len(vals) + 1
    gi = torch.arange(G).repeat_interleave(n)
    with backend(be):
        res = dk.group_filter(scores, group_size=n) if layout == "contig" else dk.group_filter(scores, gi, G)
    assert not res.keep.any() and int(res.num_kept_groups) == 0
    assert_equal(res.advantages, torch.zeros(scores.numel()), "advantages")
    assert_equal(res.group_std, torch.zeros(G), "group_std")


@pytest.mark.parametrize("be", ["torch", "triton"])
@pytest.mark.parametrize("layout", ["index", "contig"])
def test_scores_near_float64_max_keep_their_advantages(be, layout):
    """Finite scores near +-1e308 (their sums and squares overflow float64) give the float64
    reference's finite advantages, not inf std and all-zero advantages; ordinary groups alongside
    are unchanged."""
    torch.manual_seed(0)
    n = 4
    huge = torch.tensor([1e308, -1e308, 1.7e308, -1.6e308, 1.7e308, 1.7e308, 1.7e308, 1.5e308,
                         -1.79e308, -1.0e308, -1.2e308, -1.7e308], dtype=torch.float64)
    scores = torch.cat([huge, torch.randn(8, dtype=torch.float64)])
    G = scores.numel() // n
    gi = torch.arange(G).repeat_interleave(n)
    with backend(be):
        res = dk.group_filter(scores, group_size=n) if layout == "contig" else dk.group_filter(scores, gi, G)
    keep, adv, gkeep, _, gmean, gstd = group_filter_ref(scores, gi, G, epsilon=EPS)
    assert_equal(res.keep, keep, "keep")
    assert_equal(res.group_keep, gkeep, "group_keep")
    assert (adv[:12].abs() > 0.1).all()  # the reference itself is not fooled
    torch.testing.assert_close(res.advantages, adv.float(), rtol=1e-6, atol=0)
    torch.testing.assert_close(res.group_mean, gmean.float(), rtol=1e-6, atol=0)  # float32: inf where > 3.4e38
    torch.testing.assert_close(res.group_std, gstd.float(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("be", ["torch", "triton"])
def test_singletons_and_pairs(be):
    scores = torch.tensor([0.5, 1.0, 0.0, -2.0, 3.0])
    gi = torch.tensor([0, 1, 1, 2, 3])
    with backend(be):
        res = dk.group_filter(scores, gi, 5)
    check_against_ref(res, scores, gi, 5)
    assert res.keep.tolist() == [True] * 5 and res.group_keep.tolist() == [True] * 4 + [False]
    assert res.group_mean[0].item() == 0.0 and res.group_std[0].item() == 1.0  # verl's singleton rule


@pytest.mark.parametrize("be", ["torch", "triton"])
@pytest.mark.parametrize("N,G,n", [(0, 0, None), (0, 3, None), (0, None, 4)], ids=["N0-G0", "N0-G3", "N0-n4"])
def test_empty(be, N, G, n):
    scores = torch.empty(0)
    with backend(be):
        res = dk.group_filter(scores, group_size=n) if n else dk.group_filter(scores, torch.empty(0, dtype=torch.int64), G)
    assert res.keep.shape == (0,) and res.advantages.shape == (0,)
    assert res.group_keep.shape == (G or 0,) and not res.group_keep.any()
    assert res.group_size.tolist() == [0] * (G or 0)
    assert int(res.num_kept_groups) == 0
    res.check()


@pytest.mark.parametrize("be", ["torch", "triton"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_nonfinite_score_drops_its_group_and_flags(be, bad):
    scores, gi = make_scores(random_sizes(9, 8), "continuous")
    sizes = torch.bincount(gi, minlength=9)
    victim = int(torch.argmax(sizes))  # a group of several members, kept if valid
    row = int(torch.nonzero(gi == victim)[0])
    scores[row] = bad
    with backend(be):
        res = dk.group_filter(scores, gi, 9)
    assert int(res.num_invalid) == 1 and int(res.num_out_of_range) == 0
    assert not res.keep[gi == victim].any() and not bool(res.group_keep[victim])
    assert_equal(res.advantages[gi == victim], torch.zeros(int(sizes[victim])), "advantages of the bad group")
    others = gi != victim
    ok = dk.group_filter(scores[others], gi[others], 9)
    assert_equal(res.keep[others], ok.keep, "keep of the other groups")
    with pytest.raises(ValueError, match="1 score"):
        res.check()


@pytest.mark.parametrize("be", ["torch", "triton"])
@pytest.mark.parametrize("layout", ["index", "contig"])
def test_nonfinite_flag_counts(be, layout):
    scores = torch.randn(40)
    scores[[3, 17, 18]] = torch.tensor([float("nan"), float("inf"), float("nan")])
    gi = torch.arange(40) // 4
    with backend(be):
        res = dk.group_filter(scores, group_size=4) if layout == "contig" else dk.group_filter(scores, gi, 10)
    assert int(res.num_invalid) == 3
    assert res.group_keep.tolist() == [i not in (0, 4) for i in range(10)]
    assert int(res.num_kept_groups) == 8
    with pytest.raises(ValueError, match="3 score"):
        res.check()


@pytest.mark.parametrize("be", ["torch", "triton"])
def test_out_of_range_index_is_flagged_not_grouped(be):
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0, 5.0])
    gi = torch.tensor([0, 0, 1, -1, 2])  # -1 and 2 lie outside [0, 2)
    with backend(be):
        res = dk.group_filter(scores, gi, 2)
    assert int(res.num_out_of_range) == 2 and int(res.num_invalid) == 0
    assert res.keep.tolist() == [True, True, True, False, False]
    assert res.group_size.tolist() == [2, 1]
    with pytest.raises(ValueError, match="outside"):
        res.check()


def test_check_returns_result_when_clean():
    res = dk.group_filter(torch.tensor([0.0, 1.0]), group_size=2)
    assert res.check() is res


def test_requires_grad_scores_not_differentiated():
    scores = torch.randn(8, requires_grad=True)
    res = dk.group_filter(scores, group_size=4)
    assert not res.advantages.requires_grad


@pytest.mark.parametrize("call,err,match", [
    (lambda s, g: dk.group_filter(s.long(), g, 3), ValueError, "scores must have dtype"),
    (lambda s, g: dk.group_filter(s[None], g, 3), ValueError, "scores must be 1-D"),
    (lambda s, g: dk.group_filter(s, g[:-1], 3), ValueError, "group_index must have shape"),
    (lambda s, g: dk.group_filter(s, g.float(), 3), ValueError, "group_index must have dtype"),
    (lambda s, g: dk.group_filter(s, g, -1), ValueError, "num_groups must be >= 0"),
    (lambda s, g: dk.group_filter(s, g, 3.0), TypeError, "num_groups must be an int"),
    (lambda s, g: dk.group_filter(s, g), ValueError, "group_index and num_groups are required"),
    (lambda s, g: dk.group_filter(s, g, 3, group_size=2), ValueError, "either group_size"),
    (lambda s, g: dk.group_filter(s, group_size=5), ValueError, "multiple of group_size"),
    (lambda s, g: dk.group_filter(s, group_size=0), ValueError, "group_size must be >= 1"),
    (lambda s, g: dk.group_filter(s, g, 3, epsilon=-1.0), ValueError, "epsilon"),
    (lambda s, g: dk.group_filter(s, g, 3, min_std=float("nan")), ValueError, "min_std"),
    (lambda s, g: dk.group_filter(s, g, 3, norm_adv_by_std=1), TypeError, "norm_adv_by_std"),
    (lambda s, g: dk.group_filter(s.tolist(), g, 3), TypeError, "scores must be a torch.Tensor"),
], ids=["int-scores", "2d-scores", "short-index", "float-index", "neg-G", "float-G", "no-G", "both",
        "not-multiple", "n0", "neg-eps", "nan-minstd", "int-norm", "list-scores"])
def test_validation(call, err, match):
    with pytest.raises(err, match=match):
        call(torch.randn(6), torch.tensor([0, 0, 1, 1, 2, 2]))


def test_opcheck():
    scores, gi = make_scores([3, 1, 4], "binary")
    torch.library.opcheck(torch.ops.dapo.group_filter.default, (scores, gi, 3, 0, EPS, True, 0.0),
                          test_utils=("test_schema", "test_faketensor"))

