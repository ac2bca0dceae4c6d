"""dapo_kernels.integrations.verl: verl-signature functions against verl's own,
and apply() / revert() patching a verl 0.9 installation.

verl is a test-only peer (not in requirements-dev.txt: importing it needs ray, a heavy install).
The comparisons are marked ``verl``: ``make test`` runs them in .venv-verl (Makefile, test-verl,
which sets DAPO_REQUIRE_VERL=1 so that a verl that does not import fails them); elsewhere they
are skipped with the reason printed. The argument-order / signature / contract tests run in the
main group."""
import os
import inspect
import random

import numpy as np
import pytest
import torch

import dapo_kernels as dk
from dapo_kernels.integrations import verl as dkv

try:
    import verl.trainer.ppo.core_algos as core_algos
    import verl.utils.attention_utils as attention_utils
    import verl.utils.seqlen_balancing as seqlen_balancing
    from tensordict import TensorDict
    VERL_ERROR = None
except Exception as e:  # ImportError, or verl's own import-time failures (no ray, ...)
    core_algos = seqlen_balancing = attention_utils = TensorDict = None
    VERL_ERROR = f"verl 0.9 not importable ({type(e).__name__}: {e})"


def needs_verl():
    if VERL_ERROR:
        if os.environ.get("DAPO_REQUIRE_VERL") == "1":
            pytest.fail(VERL_ERROR + " in the verl test venv")
        print(VERL_ERROR)
        pytest.skip(VERL_ERROR)


class Config(dict):
    """verl's ActorConfig as the loss reads it (attributes and .get)."""
    __getattr__ = dict.get


def _config(**info):
    return Config(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                  global_batch_info=info)


def _loss_inputs(B=5, T=17, seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3
    lp = (old + 0.4 * torch.randn(B, T, generator=g)).requires_grad_()
    adv = torch.randn(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    mask[1] = 0
    return old, lp, adv, mask


SIGNATURES = {
    "compute_policy_loss_vanilla": ["old_log_prob", "log_prob", "advantages", "response_mask", "loss_agg_mode",
                                    "config", "rollout_is_weights"],
    "compute_grpo_outcome_advantage": ["token_level_rewards", "response_mask", "index", "epsilon",
                                       "norm_adv_by_std_in_grpo", "config"],
    "get_seqlen_balanced_partitions": ["seqlen_list", "k_partitions", "equal_size"],
    "rearrange_micro_batches": ["batch", "max_token_len", "dp_group", "num_batches_divided_by",
                                "same_micro_num_in_dp", "min_num_micro_batch", "use_dynamic_bsz_balance",
                                "force_group_size"],
}


@pytest.mark.parametrize("name", SIGNATURES)
def test_signatures_are_verls_documented_ones(name):
    assert list(inspect.signature(getattr(dkv, name)).parameters) == SIGNATURES[name]


@pytest.mark.verl
@pytest.mark.parametrize("name", SIGNATURES)
def test_signatures_are_verls(name):
    needs_verl()
    ours = inspect.signature(getattr(dkv, name))
    module = seqlen_balancing if name in ("get_seqlen_balanced_partitions", "rearrange_micro_batches") else core_algos
    theirs = inspect.signature(getattr(module, name))
    assert [(n, p.default) for n, p in ours.parameters.items()] == \
        [(n, p.default) for n, p in theirs.parameters.items()]


def test_verl_argument_order_is_not_swapped():
    """old_log_prob first, as verl: equal to dk.policy_loss(log_prob, old_log_prob, ...)."""
    old, lp, adv, mask = _loss_inputs()
    loss, metrics = dkv.compute_policy_loss_vanilla(old, lp, adv, mask, config=_config())
    want, want_m = dk.policy_loss(lp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert torch.equal(loss, want)
    assert metrics == {"actor/pg_clipfrac": want_m["pg_clipfrac"].item(), "actor/ppo_kl": want_m["ppo_kl"].item(),
                       "actor/pg_clipfrac_lower": want_m["pg_clipfrac_lower"].item()}
    swapped, _ = dkv.compute_policy_loss_vanilla(lp, old, adv, mask, config=_config())
    assert not torch.allclose(swapped, loss)


@pytest.mark.parametrize("mode", dk.LOSS_AGG_MODES)
def test_rollout_is_weights_go_to_the_op(mode):
    """verl's rollout_is_weights reach the op's kernels as dk.policy_loss's rollout_is_weights (the same
    bits), not folded into the aggregation weights beforehand."""
    old, lp, adv, mask = _loss_inputs()
    r = torch.rand(mask.shape, generator=torch.Generator().manual_seed(3)) + 0.5
    loss, _ = dkv.compute_policy_loss_vanilla(old, lp, adv, mask, mode, _config(), r)
    want, _ = dk.policy_loss(lp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode=mode,
                             rollout_is_weights=r)
    assert torch.equal(loss, want)
    assert torch.equal(*(torch.autograd.grad(x, lp)[0] for x in (loss, want)))


@pytest.mark.verl
@pytest.mark.parametrize("mode", dk.LOSS_AGG_MODES)
@pytest.mark.parametrize("info", [{}, dict(dp_size=2, batch_num_tokens=90, global_batch_size=9, loss_scale_factor=40)],
                         ids=["local", "dp2"])
@pytest.mark.parametrize("weights", [False, True], ids=["noweights", "rollout_is_weights"])
def test_policy_loss_matches_verl(mode, info, weights):
    needs_verl()
    old, lp, adv, mask = _loss_inputs()
    w = torch.rand(mask.shape) + 0.5 if weights else None
    cfg = _config(**info)
    loss, metrics = dkv.compute_policy_loss_vanilla(old, lp, adv, mask, mode, cfg, w)
    (g,) = torch.autograd.grad(loss, lp)
    ref, ref_metrics = core_algos.compute_policy_loss_vanilla(old, lp, adv, mask, mode, cfg, w)
    (g_ref,) = torch.autograd.grad(ref, lp)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(g, g_ref)
    assert metrics.keys() == ref_metrics.keys() and all(type(v) is float for v in metrics.values())
    for k in metrics:
        assert metrics[k] == pytest.approx(ref_metrics[k], rel=1e-5, abs=1e-7), k


@pytest.mark.verl
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_advantage_matches_verl(norm):
    needs_verl()
    g = torch.Generator().manual_seed(1)
    B, T = 24, 11
    rewards = torch.zeros(B, T)
    rewards[:, -1] = torch.randint(0, 3, (B,), generator=g).float() + torch.rand(B, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.2).float()
    index = np.array([f"uid-{i % 7}" for i in random.Random(0).sample(range(B), B)] , dtype=object)
    index[3] = "singleton"
    adv, ret = dkv.compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=norm)
    ref, ref_ret = core_algos.compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=norm)
    torch.testing.assert_close(adv, ref)
    assert adv is ret and adv.dtype == ref.dtype and adv.shape == ref.shape


def _check_partitions(parts, n, k):
    assert len(parts) == k and all(parts) and all(p == sorted(p) for p in parts)
    assert sorted(i for p in parts for i in p) == list(range(n))


@pytest.mark.parametrize("equal_size", [False, True])
def test_balanced_partitions_keep_verls_contract_and_balance(equal_size):
    rng = np.random.default_rng(2)
    lengths = rng.integers(1, 4000, size=48).tolist()
    parts = dkv.get_seqlen_balanced_partitions(lengths, 6, equal_size)
    _check_partitions(parts, 48, 6)
    if equal_size:
        assert {len(p) for p in parts} == {8}


@pytest.mark.verl
@pytest.mark.parametrize("equal_size", [False, True])
def test_balanced_partitions_no_wider_than_verls(equal_size):
    needs_verl()
    lengths = np.random.default_rng(2).integers(1, 4000, size=48).tolist()
    parts = dkv.get_seqlen_balanced_partitions(lengths, 6, equal_size)
    ref = seqlen_balancing.get_seqlen_balanced_partitions(lengths, 6, equal_size)
    spread = [max(s) - min(s) for s in ([sum(lengths[i] for i in p) for p in ps] for ps in (parts, ref))]
    assert spread[0] <= spread[1]


def _tensordict_batch(B=16, S=64, seed=3):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, S + 1, (B,), generator=g)
    mask = (torch.arange(S)[None, :] < lens[:, None]).long()
    return TensorDict({"input_ids": torch.randint(0, 100, (B, S), generator=g), "attention_mask": mask},
                      batch_size=[B])


@pytest.mark.verl
@pytest.mark.parametrize("force_group_size", [1, 2])
def test_rearrange_micro_batches_matches_verls_contract(force_group_size):
    needs_verl()
    batch = _tensordict_batch()
    mbs, idx = dkv.rearrange_micro_batches(batch, 160, force_group_size=force_group_size)
    ref_mbs, ref_idx = seqlen_balancing.rearrange_micro_batches(batch, 160, force_group_size=force_group_size)
    assert len(mbs) <= len(ref_idx)
    assert sorted(i for p in idx for i in p) == list(range(16))
    lens = batch["attention_mask"].sum(1)
    for mb, p in zip(mbs, idx):
        assert int(lens[p].sum()) <= 160
        assert torch.equal(mb["input_ids"], batch["input_ids"][p])
        if force_group_size == 2:
            assert all(p[j] // 2 == p[j + 1] // 2 for j in range(0, len(p), 2))


@pytest.mark.verl
def test_apply_and_revert():
    needs_verl()
    originals = (core_algos.POLICY_LOSS_REGISTRY["vanilla"], core_algos.ADV_ESTIMATOR_REGISTRY["grpo"],
                 seqlen_balancing.rearrange_micro_batches, attention_utils.unpad_input)
    old, lp, adv, mask = _loss_inputs()
    before = core_algos.get_policy_loss_fn("vanilla")(old, lp, adv, mask, "token-mean", _config())
    x = torch.randn(3, 8, 4)
    am = torch.tensor([[1] * 8, [1] * 3 + [0] * 5, [0] * 2 + [1] * 6])
    unpad_before = attention_utils.unpad_input(x, am)
    dkv.apply()
    try:
        assert core_algos.get_policy_loss_fn("vanilla") is dkv.compute_policy_loss_vanilla
        assert core_algos.get_policy_loss_fn(dkv.POLICY_LOSS_NAME) is dkv.compute_policy_loss_vanilla
        assert core_algos.get_adv_estimator_fn("grpo") is dkv.compute_grpo_outcome_advantage
        after = core_algos.get_policy_loss_fn("vanilla")(old, lp, adv, mask, "token-mean", _config())
        torch.testing.assert_close(after[0], before[0])
        assert after[1] == pytest.approx(before[1])
        unpad_after = attention_utils.unpad_input(x, am)
        for a, b in zip(unpad_after, unpad_before):
            assert (a == b) if isinstance(a, int) else torch.equal(a, b)
        assert torch.equal(attention_utils.pad_input(unpad_after[0], unpad_after[1], 3, 8), x * am[..., None])
        mbs, idx = seqlen_balancing.rearrange_micro_batches(_tensordict_batch(), 160)
        assert sorted(i for p in idx for i in p) == list(range(16))
    finally:
        dkv.revert()
    assert (core_algos.POLICY_LOSS_REGISTRY["vanilla"], core_algos.ADV_ESTIMATOR_REGISTRY["grpo"],
            seqlen_balancing.rearrange_micro_batches, attention_utils.unpad_input) == originals
    assert dkv.POLICY_LOSS_NAME not in core_algos.POLICY_LOSS_REGISTRY
