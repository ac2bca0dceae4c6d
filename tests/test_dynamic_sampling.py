"""DynamicBatchAccumulator: exact batch size, whole groups, carry-over, exhaustion, metrics.

Every response row carries a unique id, so "nothing kept is lost or duplicated" is a
set comparison between the rows group_filter kept and the rows taken or still buffered.
"""
import pytest
import torch

import dapo_kernels as dk
from tests.helpers import case_id


class Generator:
    """Generation batches of ``prompts`` groups of ``n`` responses, rows shuffled."""

    def __init__(self, prompts: int, n: int, p_correct: float = 0.5):
        self.prompts, self.n, self.p = prompts, n, p_correct
        self.next_prompt = 0

    def batch(self):
        G, n = self.prompts, self.n
        gi = torch.arange(G).repeat_interleave(n)
        prompt = gi + self.next_prompt
        self.next_prompt += G
        # per-prompt difficulty so some groups are all-correct / all-wrong
        p = torch.rand(G)[gi] * 2 * self.p
        scores = (torch.rand(G * n) < p).float()
        row_id = prompt * n + torch.arange(G * n) % n
        perm = torch.randperm(G * n)
        tensors = {"row_id": row_id[perm], "prompt": prompt[perm], "x": torch.randn(G * n, 3)[perm]}
        return tensors, gi[perm], scores[perm]


def kept_ids(tensors, keep):
    return set(tensors["row_id"][keep].tolist())


def assert_whole_groups(out, tbs, n):
    assert out["group_index"].tolist() == torch.arange(tbs).repeat_interleave(n).tolist()
    prompts = out["prompt"].reshape(tbs, n)
    assert (prompts == prompts[:, :1]).all(), "rows of a group are not contiguous"
    assert prompts[:, 0].unique().numel() == tbs, "a prompt group appears twice"
    assert (out["row_id"].reshape(tbs, n) // n == prompts).all()


CASES = [(4, 3, 5, True), (16, 8, 7, True), (16, 8, 7, False), (1, 1, 3, True), (33, 16, 40, True)]


@pytest.mark.parametrize("tbs,n,prompts,carry", CASES,
                         ids=[case_id(tbs=t, n=n, P=p, carry=c) for t, n, p, c in CASES])
def test_steps_exact_whole_nothing_lost(tbs, n, prompts, carry):
    gen = Generator(prompts, n)
    acc = dk.DynamicBatchAccumulator(tbs, n, 0, carry_over=carry)
    all_kept, taken = set(), []
    for _ in range(4):  # training steps
        added = 0
        while not acc.ready:
            tensors, gi, scores = gen.batch()
            res = dk.group_filter(scores, gi, prompts)
            acc.add(tensors, gi, res.keep, scores=scores)
            all_kept |= kept_ids(tensors, res.keep)
            added += 1
        before = acc.num_buffered_groups
        out = acc.take()
        assert set(out) == {"row_id", "prompt", "x", "group_index"}
        assert out["x"].shape == (tbs * n, 3)
        assert_whole_groups(out, tbs, n)
        taken += out["row_id"].tolist()
        m = acc.last_metrics
        assert m["dynamic_sampling/gen_batches"] == added
        assert m["dynamic_sampling/groups_carried_over"] == (before - tbs if carry else 0)
        assert m["dynamic_sampling/groups_discarded"] == (0 if carry else before - tbs)
        assert acc.num_buffered_groups == (before - tbs if carry else 0)
    assert len(taken) == len(set(taken)), "a row was taken twice"
    buffered = set(torch.cat([c["row_id"] for c in acc._chunks]).tolist()) if acc._chunks else set()
    assert not (buffered & set(taken))
    if carry:
        assert set(taken) | buffered == all_kept, "a kept row was lost"
    else:
        assert set(taken) <= all_kept


def test_surplus_is_carried_into_next_step_first():
    acc = dk.DynamicBatchAccumulator(2, 2, 0)
    t = {"v": torch.arange(8)}
    acc.add(t, torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]), torch.ones(8, dtype=torch.bool))
    assert acc.take()["v"].tolist() == [0, 1, 2, 3]
    assert acc.ready and acc.last_metrics["dynamic_sampling/groups_carried_over"] == 2
    assert acc.metrics()["dynamic_sampling/groups_carried_in"] == 2
    assert acc.take()["v"].tolist() == [4, 5, 6, 7]
    assert not acc.ready


def test_groups_made_contiguous_in_group_order():
    acc = dk.DynamicBatchAccumulator(2, 2, 0)
    gi = torch.tensor([2, 0, 1, 0, 2, 1])
    keep = torch.tensor([True, False, False, False, True, False])
    acc.add({"v": torch.arange(6)}, gi, keep)
    assert not acc.ready and acc.num_buffered_groups == 1
    acc.add({"v": torch.arange(10, 16)}, gi, ~keep)
    assert acc.take()["v"].tolist() == [0, 4, 11, 13]  # batch 1's group 2, then batch 2's group 0
    assert acc.num_buffered_groups == 1


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_extreme_group_indices_are_ordinary_groups(dtype):
    """The largest / smallest index of the dtype is a group like any other (no index value is
    reserved to mark dropped rows)."""
    hi, lo = torch.iinfo(dtype).max, torch.iinfo(dtype).min
    acc = dk.DynamicBatchAccumulator(2, 2, 0)
    gi = torch.tensor([hi, 7, lo, hi, 7, lo], dtype=dtype)
    keep = torch.tensor([True, False, True, True, False, True])
    acc.add({"v": torch.arange(6)}, gi, keep)
    assert acc.num_buffered_groups == 2 and acc.metrics()["dynamic_sampling/groups_seen"] == 3
    assert acc.take()["v"].tolist() == [2, 5, 0, 3]  # group lo, then group hi
    # A dropped group at the top index next to a kept one below it.
    acc.add({"v": torch.arange(4)}, torch.tensor([hi, 0, hi, 0], dtype=dtype),
            torch.tensor([False, True, False, True]))
    acc.add({"v": torch.arange(4)}, torch.tensor([hi, 0, hi, 0], dtype=dtype),
            torch.tensor([True, False, True, False]))
    assert acc.take()["v"].tolist() == [1, 3, 0, 2]


def test_exhaustion_error():
    acc = dk.DynamicBatchAccumulator(8, 4, 3)
    gen = Generator(5, 4, p_correct=0.1)
    kept_per_batch = []
    with pytest.raises(dk.DynamicSamplingExhausted) as ei:
        for _ in range(3):
            tensors, gi, scores = gen.batch()
            scores[gi >= 1] = 1.0  # at most group 0 can be kept
            res = dk.group_filter(scores, gi, 5)
            kept_per_batch.append(int(res.num_kept_groups))
            acc.add(tensors, gi, res.keep, scores=scores)
    assert len(kept_per_batch) == 3, "raised before max_num_gen_batches batches were used"
    assert isinstance(ei.value, RuntimeError)
    msg = str(ei.value)
    assert "3 generation batches" in msg and f"kept {kept_per_batch} groups per batch" in msg
    assert f"keep rate {sum(kept_per_batch) / 15:.1%}" in msg
    for setting in ("max_num_gen_batches", "gen_batch_size", "rollout.n"):
        assert setting in msg


def test_unlimited_never_raises():
    acc = dk.DynamicBatchAccumulator(1, 2, 0)
    for _ in range(20):
        acc.add({"v": torch.arange(2)}, torch.tensor([0, 0]), torch.zeros(2, dtype=torch.bool))
    assert acc.metrics()["dynamic_sampling/gen_batches"] == 20 and not acc.ready


def test_metrics_all_correct_all_wrong():
    G, n = 30, 4
    gi = torch.arange(G).repeat_interleave(n)
    scores = torch.randint(0, 2, (G * n,)).float()
    scores[gi < 5] = 1.0
    scores[(gi >= 5) & (gi < 12)] = 0.0
    res = dk.group_filter(scores, gi, G)
    acc = dk.DynamicBatchAccumulator(1000, n, 0)
    acc.add({"v": scores}, gi, res.keep, scores=scores)
    by_group = [scores[gi == g].tolist() for g in range(G)]
    m = acc.metrics()
    assert m["dynamic_sampling/groups_all_correct"] == sum(set(v) == {1.0} for v in by_group)
    assert m["dynamic_sampling/groups_all_wrong"] == sum(set(v) == {0.0} for v in by_group)
    assert m["dynamic_sampling/groups_seen"] == G
    uniform = m["dynamic_sampling/groups_all_correct"] + m["dynamic_sampling/groups_all_wrong"]
    assert m["dynamic_sampling/groups_kept"] == int(res.num_kept_groups) == G - uniform
    assert m["dynamic_sampling/keep_rate"] == pytest.approx(m["dynamic_sampling/groups_kept"] / G)


def test_partial_group_rejected_nothing_appended():
    acc = dk.DynamicBatchAccumulator(2, 2, 0)
    with pytest.raises(ValueError, match="exactly n_per_prompt=2"):
        acc.add({"v": torch.arange(4)}, torch.tensor([0, 0, 1, 1]), torch.tensor([True, False, True, True]))
    assert acc.num_buffered_groups == 0 and not acc._chunks
    with pytest.raises(ValueError, match="exactly n_per_prompt=2"):  # a kept group of 3 rows
        acc.add({"v": torch.arange(3)}, torch.tensor([0, 0, 0]), torch.ones(3, dtype=torch.bool))


@pytest.mark.parametrize("call,err,match", [
    (lambda a: a.take(), RuntimeError, "only 0 are buffered"),
    (lambda a: a.add([], torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.bool)), TypeError, "dict"),
    (lambda a: a.add({"v": torch.arange(3)}, torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.bool)),
     ValueError, "must have 2 rows"),
    (lambda a: a.add({"group_index": torch.arange(2)}, torch.zeros(2, dtype=torch.long),
                     torch.ones(2, dtype=torch.bool)), ValueError, "must not contain 'group_index'"),
    (lambda a: a.add({"v": torch.arange(2)}, torch.zeros(2), torch.ones(2, dtype=torch.bool)),
     ValueError, "group_index must have dtype"),
    (lambda a: a.add({"v": torch.arange(2)}, torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.complex64)),
     ValueError, "keep must have dtype"),
], ids=["take-empty", "not-dict", "rows", "reserved-key", "float-index", "complex-keep"])
def test_validation(call, err, match):
    with pytest.raises(err, match=match):
        call(dk.DynamicBatchAccumulator(2, 2, 0))


def test_key_change_rejected_and_constructor_checks():
    acc = dk.DynamicBatchAccumulator(4, 2, 0)
    acc.add({"v": torch.arange(2)}, torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="keys"):
        acc.add({"w": torch.arange(2)}, torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="train_batch_size must be >= 1"):
        dk.DynamicBatchAccumulator(0, 2, 0)
    with pytest.raises(TypeError, match="carry_over"):
        dk.DynamicBatchAccumulator(1, 2, 0, carry_over=None)


def test_state_dict_round_trip_restores_carried_groups():
    gen = Generator(prompts=7, n=4)
    acc = dk.DynamicBatchAccumulator(5, 4, 0)
    for _ in range(100):  # a fill can end exactly at the batch size: go on until one carries groups over
        while not acc.ready:
            tensors, gi, scores = gen.batch()
            acc.add(tensors, gi, dk.group_filter(scores, gi, 7).keep)
        acc.take()
        if acc.num_buffered_groups:
            break
    carried = acc.num_buffered_groups
    state = acc.state_dict()
    fresh = dk.DynamicBatchAccumulator(5, 4, 0)
    fresh.load_state_dict(state)
    assert fresh.num_buffered_groups == carried > 0
    assert fresh.metrics()["dynamic_sampling/groups_carried_in"] == carried
    # Both continue identically on the same next batches.
    for a in (acc, fresh):
        g = Generator(prompts=7, n=4)
        g.next_prompt = 1000
        torch.manual_seed(1)
        while not a.ready:
            tensors, gi, scores = g.batch()
            a.add(tensors, gi, dk.group_filter(scores, gi, 7).keep)
    out_a, out_b = acc.take(), fresh.take()
    assert out_a.keys() == out_b.keys()
    for k in out_a:
        assert torch.equal(out_a[k], out_b[k]), k
    with pytest.raises(ValueError, match="missing"):
        fresh.load_state_dict({"chunks": []})


def test_state_with_another_n_per_prompt_is_refused_naming_both():
    """State buffering groups of 2 rows loaded into an accumulator of n_per_prompt=3 (issue 40 item 4:
    take() then returned 6 rows with a 9-row group_index) is a ValueError naming both values, with or
    without the saved n_per_prompt; without buffered groups it loads under any n_per_prompt."""
    acc = dk.DynamicBatchAccumulator(3, 2)
    acc.add({"x": torch.arange(8.0)}, torch.arange(4).repeat_interleave(2), torch.ones(8, dtype=torch.bool))
    acc.take()
    state = acc.state_dict()
    assert state["num_buffered_groups"] == 1 and state["n_per_prompt"] == 2
    legacy = {k: v for k, v in state.items() if k != "n_per_prompt"}
    for s in (state, legacy):
        with pytest.raises(ValueError, match=r"buffers 1 groups of n_per_prompt=2 rows; this accumulator has "
                                             r"n_per_prompt=3"):
            dk.DynamicBatchAccumulator(3, 3).load_state_dict(s)
    empty = dk.DynamicBatchAccumulator(3, 2).state_dict()
    other = dk.DynamicBatchAccumulator(3, 3)
    other.load_state_dict(empty)
    assert other.num_buffered_groups == 0


@pytest.mark.parametrize("state,exc,match", [
    ("garbage", TypeError, "must be a mapping"),
    ({"chunks": [1, 2], "keys": None, "num_buffered_groups": 0, "carried_in": 0}, TypeError, r"\['chunks'\]"),
    ({"chunks": [], "keys": 5, "num_buffered_groups": 0, "carried_in": 0}, TypeError, r"\['keys'\]"),
    ({"chunks": [], "keys": None, "num_buffered_groups": "x", "carried_in": 0}, ValueError, "num_buffered_groups"),
    ({"chunks": [], "keys": None, "num_buffered_groups": 0, "carried_in": -1}, ValueError, "carried_in"),
], ids=["str", "chunks", "keys", "groups", "carried-in"])
def test_load_state_dict_garbage_names_the_entry(state, exc, match):
    """A state that is no state_dict() is refused naming the entry, not with dict()'s or int()'s message."""
    with pytest.raises(exc, match=match):
        dk.DynamicBatchAccumulator(3, 2).load_state_dict(state)
