"""``actor_rollout_ref.actor.mask_truncated_completions``: DAPO's overlong filtering (TRL's key).

A response cut at ``data.max_response_length`` (``TrainBatch.stopped`` false) trains no token and leaves the
loss's token counts: the update with the key on is the update of the same batch with those responses'
sampled masks cleared, bit for bit; off (the default) it is the update it was before.
"""
from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from dapo_trainer.actor import Actor
from dapo_trainer.config import load_config
from dapo_trainer.hf_io import load_hf_model
from dapo_trainer.parallel import ParallelDims
from tests.trainer.tiny import micro_setup, train_batch

KEY = "actor_rollout_ref.actor.mask_truncated_completions"


def _batch(n=8, p=5, r=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    response_len = torch.randint(1, r + 1, (n,), generator=g)
    sampled = torch.arange(r)[None, :] < response_len[:, None]
    stopped = torch.tensor([True, False] * (n // 2))  # every other response was cut at the length limit
    return train_batch(prompt_ids=torch.randint(2, 20, (n, p), generator=g),
                       response_ids=torch.randint(2, 20, (n, r), generator=g),
                       prompt_len=torch.randint(2, p + 1, (n,), generator=g), response_len=response_len,
                       sampled=sampled, stopped=stopped, turns=torch.ones(n, dtype=torch.float64),
                       advantages=torch.randn(n, generator=g), log_probs=-torch.rand(n, r, generator=g))


def _update(tmp_path, batch, *overrides):
    """(metrics without timings, weights after) of one Actor.update on a fresh copy of the tiny model."""
    cfg = load_config(None, [*micro_setup(str(tmp_path)), "actor_rollout_ref.rollout.n=4",
                             "actor_rollout_ref.actor.ppo_mini_batch_size=1", *overrides])
    dev = torch.device("cpu")
    model = load_hf_model(str(tmp_path / "model"))
    dims = ParallelDims.build(cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout.n, dev)
    torch.manual_seed(0)
    m = Actor(cfg, dims, model, device=dev).update(copy.deepcopy(batch))
    return {k: v for k, v in m.items() if not k.startswith("timing_s/")}, model.state_dict()


def test_default_is_off_and_the_key_loads(tmp_path):
    root = micro_setup(str(tmp_path))
    assert load_config(None, root).actor_rollout_ref.actor.mask_truncated_completions is False
    assert load_config(None, [*root, f"{KEY}=true"]).actor_rollout_ref.actor.mask_truncated_completions is True


def test_truncated_responses_leave_the_loss(tmp_path):
    """On: the same update as the batch whose truncated responses sample nothing (two mini-batches, so the old
    log-probs and the token counts per mini-batch both take the mask); off: a different one."""
    batch = _batch()
    on, w_on = _update(tmp_path, batch, f"{KEY}=true")
    cleared = replace(batch, sampled=batch.sampled & batch.stopped[:, None])
    same, w_same = _update(tmp_path, cleared)
    off, w_off = _update(tmp_path, batch)
    assert on == same
    for name in w_on:
        assert torch.equal(w_on[name], w_same[name]), name
    assert any(not torch.equal(w_on[n], w_off[n]) for n in w_on) and on["actor/pg_loss"] != off["actor/pg_loss"]


def test_every_response_truncated_trains_nothing(tmp_path):
    """Every response cut: no token in the loss, a zero loss and gradient, no error."""
    batch = replace(_batch(), stopped=torch.zeros(8, dtype=torch.bool))
    m, _ = _update(tmp_path, batch, f"{KEY}=true", "actor_rollout_ref.actor.optim.weight_decay=0")
    assert m["actor/pg_loss"] == 0.0 and m["actor/grad_norm"] == 0.0 and m["actor/skipped_updates"] == 0


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_seq_modes_count_the_masked_response_as_trl_does(tmp_path, mode):
    """Sequence-mean modes: a truncated response adds 0 and still counts as a sequence of its mini-batch
    (TRL's per-sequence mean over the completion mask, then the mean over every sequence)."""
    batch = _batch(seed=1)
    on, _ = _update(tmp_path, batch, f"{KEY}=true", f"actor_rollout_ref.actor.loss_agg_mode={mode}")
    cleared = replace(batch, sampled=batch.sampled & batch.stopped[:, None])
    same, _ = _update(tmp_path, cleared, f"actor_rollout_ref.actor.loss_agg_mode={mode}")
    assert on == same
