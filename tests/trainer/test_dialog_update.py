"""The update side of multi-turn training: the micro-batch token cap scaled by the
batch's dialogue turns (``actor.dynamic_token_len``) and its utilisation, and old / reference
log-probs projected onto the vocabulary only where the response mask is set."""
import random
from dataclasses import replace

import pytest
import torch

from dapo_trainer.config import DynamicTokenLenConfig, load_config
from dapo_trainer.hf_io import load_hf_model
from dapo_trainer.actor import masked_log_probs, pack_micro_batch, scaled_token_len
from dapo_trainer.trainer import DAPOTrainer
from tests.tolerance import assert_close_to_ref
from tests.trainer.test_multiturn import echo_setup
from tests.trainer.tiny import micro_setup, train_batch, write_tiny_model

ISSUE = DynamicTokenLenConfig(long_turns=5, long_factor=1.5, short_turns=2, short_factor=0.7, max_token_len=5000)


@pytest.mark.parametrize("turns, longest, expected", [
    (5.0, 10, 4096 * 3 // 2), (7.5, 10, 4096 * 3 // 2),  # long: 1.5x (6144, under the ceiling)
    (2.0, 10, int(4096 * 0.7)), (1.0, 10, int(4096 * 0.7)),  # short: 0.7x
    (3.5, 10, 4096), (4.99, 10, 4096), (2.01, 10, 4096),  # in between: unscaled
    (1.0, 3000, 3000),  # never below the longest sequence
])
def test_scaled_token_len_follows_mean_turns(turns, longest, expected):
    cfg = DynamicTokenLenConfig(**{**ISSUE.__dict__, "max_token_len": 8192})
    assert scaled_token_len(4096, turns, cfg, longest) == expected


def test_scaled_token_len_never_exceeds_the_memory_ceiling():
    assert scaled_token_len(4096, 6.0, ISSUE, 10) == 5000  # 1.5 x 4096 = 6144 > 5000
    off = DynamicTokenLenConfig()  # the defaults scale nothing
    assert [scaled_token_len(4096, t, off, 10) for t in (1.0, 3.0, 9.0)] == [4096] * 3
    # No ceiling configured: the base is the ceiling, so only scaling down applies.
    assert scaled_token_len(4096, 9.0, DynamicTokenLenConfig(long_factor=1.0, short_factor=0.5), 10) == 4096


def test_dynamic_token_len_config_keys_and_errors():
    key = "actor_rollout_ref.actor.dynamic_token_len"
    cfg = load_config(overrides=[f"{key}={{long_turns: 5, long_factor: 1.5, short_turns: 2, short_factor: 0.7, "
                                 f"max_token_len: 20000}}"])
    d = cfg.actor_rollout_ref.actor.dynamic_token_len
    assert (d.long_turns, d.long_factor, d.short_turns, d.short_factor, d.max_token_len) == (5, 1.5, 2, 0.7, 20000)
    with pytest.raises(ValueError, match=rf"'{key}.max_token_len'.*long_factor"):
        load_config(overrides=[f"{key}.long_factor=1.5"])
    with pytest.raises(ValueError, match=rf"'{key}.short_turns'"):
        load_config(overrides=[f"{key}.short_turns=6"])
    with pytest.raises(ValueError, match=rf"'{key}.max_token_len'.*longest sequence"):
        load_config(overrides=[f"{key}.max_token_len=100"])
    with pytest.raises(ValueError, match=rf"'{key}.short_factor'"):
        load_config(overrides=[f"{key}.short_factor=0"])


def test_update_scales_micro_batches_by_turns_and_reports_utilization(tmp_path):
    key = "actor_rollout_ref.actor.dynamic_token_len"
    base = micro_setup(str(tmp_path)) + [
        "trainer.val_before_train=false", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24",
        f"{key}={{long_turns: 5, long_factor: 1.5, short_turns: 2, short_factor: 0.7, max_token_len: 32}}"]
    trainer = DAPOTrainer(load_config(overrides=base))
    batch, _ = trainer.generation.collect(1)
    assert torch.equal(batch.turns, torch.ones_like(batch.turns))  # single-turn rows: 1 turn
    seqlens = (batch.prompt_len + batch.response_len).tolist()
    caps, micro = {}, {}
    for turns in (1.0, 3.0, 6.0):
        batch = replace(batch, turns=torch.full_like(batch.turns, turns))
        plan = trainer.actor.plan(batch)
        caps[turns] = {p.max_token_len for p in plan}
        micro[turns] = sum(len(p.micro) for p in plan)
        for p in plan:
            assert all(sum(seqlens[i] for i in mb) <= p.max_token_len for mb in p.micro)
    # 0.7 x 24 = 16 (the longest sequence is shorter), 24, min(36, ceiling 32).
    assert caps == {1.0: {max(16, max(seqlens))}, 3.0: {24}, 6.0: {32}}, caps
    assert micro[1.0] >= micro[3.0] >= micro[6.0] and micro[1.0] > micro[6.0], micro
    m = trainer.actor.update(batch)  # num_turns 6: the long cap
    assert m["actor/max_token_len"] == 32 and m["actor/num_micro_batches"] == micro[6.0]
    assert m["actor/micro_batch_utilization"] == pytest.approx(sum(seqlens) / (micro[6.0] * 32))
    assert 0 < m["actor/micro_batch_utilization"] <= 1


def test_multiturn_batch_carries_each_dialogues_turns(tmp_path):
    overrides = echo_setup(tmp_path) + ["algorithm.filter_groups.enable=false", "trainer.val_before_train=false"]
    trainer = DAPOTrainer(load_config(overrides=overrides))
    batch, _ = trainer.generation.collect(1)
    # An assistant turn is a run of sampled tokens: the runs of the response mask count the turns.
    for row, turns in enumerate(batch.turns.tolist()):
        m = batch.sampled[row, :int(batch.response_len[row])].tolist()
        runs = sum(1 for i, x in enumerate(m) if x and (i == 0 or not m[i - 1]))
        assert turns == runs, (row, turns, m)
    assert batch.turns.max() > 1


def _multiturn_micro_batch(V, gen):
    """A packed batch of 5 dialogues: random prompt / response tokens, responses that alternate
    sampled and environment spans (``pack_micro_batch`` lays them out and builds the mask)."""
    B, P, R = 5, 7, 12
    prompt_len = torch.randint(2, P + 1, (B,), generator=gen)
    response_len = torch.randint(3, R + 1, (B,), generator=gen)
    mask = torch.zeros(B, R, dtype=torch.bool)
    for b in range(B):  # spans of 1-3 tokens, sampled first
        t, sampled = 0, True
        while t < R:
            w = int(torch.randint(1, 4, (1,), generator=gen))
            mask[b, t:t + w] = sampled
            t, sampled = t + w, not sampled
    batch = train_batch(prompt_ids=torch.randint(2, V, (B, P), generator=gen), prompt_len=prompt_len,
                        response_ids=torch.randint(2, V, (B, R), generator=gen), response_len=response_len,
                        sampled=mask, advantages=torch.randn(B, generator=gen))
    return pack_micro_batch(batch, list(range(B)), torch.device("cpu"))


def test_old_and_ref_log_probs_projected_only_where_the_mask_is_set(tmp_path):
    model = load_hf_model(write_tiny_model(str(tmp_path / "m"), layers=2), torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(random.randrange(10**6))
    mb = _multiturn_micro_batch(model.config.vocab_size, gen)
    mask = mb.mask
    assert 0 < int(mask.sum()) < mask.numel() // 2  # prompts and environment spans are masked out
    rows = []
    log_probs = model.log_probs

    def spy(hidden, labels, **kw):
        rows.append(hidden.shape[0])
        return log_probs(hidden, labels, **kw)

    model.log_probs = spy
    with torch.no_grad():
        out = masked_log_probs(model, mb, temperature=0.7)
        hidden = model(mb.input_ids, mb.cu_seqlens, mb.max_seqlen)
    assert rows == [int(mask.sum())]  # the vocabulary projection saw the sampled tokens only
    assert out.shape == mask.shape and torch.all(out[~mask] == 0)
    h, labels, w = hidden[mask], mb.labels[mask], model.lm_head.weight
    ref64 = torch.log_softmax(h.double() @ w.double().T / 0.7, -1).gather(1, labels[:, None].long())[:, 0]
    torch32 = torch.log_softmax(h @ w.T / 0.7, -1).gather(1, labels[:, None].long())[:, 0]
    assert_close_to_ref(out[mask], ref64, torch32, name="masked log-probs")
