"""Host-sync budgets, counted on the CPU (tests/sync_counter.py): what a GPU step would stall on.

The budgets are those of the Triton path (what CUDA runs; here under the interpreter). The torch
path is CPU-only code, where reading a value costs nothing; its packed-model count must still not
grow with depth (the length buckets are per-batch metadata too).
"""
import pytest
import torch

import dapo_kernels as dk
from dapo_trainer.model import ModelConfig, Transformer
from tests.helpers import backend, cu_seqlens_from
from tests.sync_counter import count_host_syncs


def _count(fn, be="triton"):
    with backend(be), count_host_syncs() as c:
        fn()
    return c


def test_counter_sees_each_kind_of_read():
    """The counter is not blind: every door from values to Python counts once, including inside a custom op."""
    x = torch.arange(6.0)
    reads = [
        lambda: x.tolist(), lambda: x[0].item(), lambda: bool(x[1]), lambda: int(x[2]), lambda: float(x[3]),
        lambda: x.numpy(), lambda: x.nonzero(), lambda: x.masked_select(x > 2), lambda: x[x > 2],
        lambda: torch.unique(x), lambda: torch.repeat_interleave(torch.tensor([1, 2])),
        lambda: range(10)[torch.tensor(3)],
    ]
    for i, read in enumerate(reads):
        with count_host_syncs() as c:
            read()
        assert c.count == 1, f"read {i}: {c.count}\n{c.report()}"
    with count_host_syncs() as c:
        x + 1
        torch.repeat_interleave(torch.tensor([1, 2]), torch.tensor([2, 1]), output_size=3)
        x.repeat_interleave(2, 0)
    assert c.count == 0, c.report()
    # unpad_input's one read happens inside its Python body, the others inside dapo ops.
    with count_host_syncs() as c:
        dk.unpad_input(torch.randn(2, 3, 4), torch.tensor([[1, 1, 0], [1, 0, 0]]))
    assert c.count == 1, c.report()


def _model(layers: int) -> Transformer:
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=layers, num_heads=4,
                      num_kv_heads=2, head_dim=16)
    return Transformer(cfg).init_weights(std=0.1)


@pytest.mark.parametrize("be", ["triton", "torch"])
def test_model_forward_backward_reads_do_not_grow_with_depth(be):
    lengths = [7, 1, 0, 12]
    ids = torch.randint(0, 64, (sum(lengths),))
    counts = {}
    for layers in (2, 8):
        model = _model(layers)
        cu = cu_seqlens_from(lengths)  # a new batch per model: nothing carried over

        def step():
            model(ids, cu, max(lengths)).square().sum().backward()

        c = _count(step, be)
        counts[layers] = c.count
        if be == "triton":
            assert c.count <= 1, f"{layers} layers, triton path:\n{c.report()}"
    assert counts[2] == counts[8], counts


def test_fused_loss_forward_backward_reads_at_most_once():
    n, h, v = 19, 16, 40
    hidden, weight = torch.randn(n, h, requires_grad=True), torch.randn(v, h, requires_grad=True)
    labels = torch.randint(0, v, (n,))

    def step():
        loss, _ = dk.fused_linear_policy_loss(hidden, weight, labels, -torch.rand(n), torch.randn(n),
                                              torch.rand(n) > 0.3, entropy_coeff=0.01,
                                              rollout_is_weights=torch.rand(n) + 0.5)
        loss.backward()

    c = _count(step)
    assert c.count <= 1, c.report()


@pytest.mark.parametrize("be", ["triton", "torch"])
def test_ops_without_reads(be):
    scores = torch.rand(16)
    lp = torch.randn(4, 6, requires_grad=True)
    old, adv, mask = -torch.rand(4, 6), torch.randn(4, 6), torch.rand(4, 6) > 0.2
    x = torch.randn(3, 5, 8, requires_grad=True)
    am = torch.tensor([[1, 1, 0, 0, 0], [0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    x_unpad, indices, cu, max_len, _ = dk.unpad_input(x, am)  # its one read is budgeted below
    cases = {
        "group_filter(group_size)": lambda: dk.group_filter(scores, group_size=4),
        "group_filter(group_index)": lambda: dk.group_filter(scores, torch.arange(16) // 4, 4),
        "policy_loss(token-mean)": lambda: dk.policy_loss(lp, old, adv, mask)[0].backward(),
        "policy_loss(token-sum)": lambda: dk.policy_loss(lp, old, adv, mask, loss_agg_mode="token-sum")[0].backward(),
        "policy_loss(rollout_is_weights)": lambda: dk.policy_loss(lp, old, adv, mask,
                                                                  rollout_is_weights=torch.rand(4, 6))[0].backward(),
        "pad_input(unpad's indices)": lambda: dk.pad_input(x_unpad * 2, indices, 3, 5).sum().backward(),
        "packed_position_ids(unpad's cu_seqlens)": lambda: dk.packed_position_ids(cu, x_unpad.shape[0]),
    }
    for name, fn in cases.items():
        c = _count(fn, be)
        assert c.count == 0, f"{name}:\n{c.report()}"
    c = _count(lambda: dk.unpad_input(x, am)[0].sum().backward(), be)
    assert c.count == 1, c.report()


def test_cu_seqlens_checked_again_after_an_in_place_write():
    """The per-batch cache keys on the tensor and its version: a write in place is seen."""
    q = torch.randn(10, 2, 16)
    cu = cu_seqlens_from([4, 6])
    dk.varlen_attention(q, q, q, cu, 6)
    c = _count(lambda: dk.varlen_attention(q, q, q, cu, 6))
    assert c.count == 0, c.report()
    cu[1] = 11  # now decreasing
    with pytest.raises(ValueError, match="non-decreasing"):
        dk.varlen_attention(q, q, q, cu, 6)
    # Same values in a new tensor: checked (one read), not trusted by value.
    c = _count(lambda: dk.varlen_attention(q, q, q, cu_seqlens_from([4, 6]), 6))
    assert c.count == 1, c.report()


def test_pad_input_still_checks_indices_it_did_not_produce():
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="indices must lie in"):
        dk.pad_input(x, torch.tensor([0, 5, 8]), 2, 4)
    c = _count(lambda: dk.pad_input(x, torch.tensor([0, 5, 7]), 2, 4))
    assert c.count == 1, c.report()


def test_trainer_update_reads_nothing_inside_the_micro_batch_loop(tmp_path, monkeypatch):
    """Actor.update(): host-side planning and packing aside, its reads do not depend on the number of
    micro-batches (one per optimizer update, for its loss and gradient norm, and one for the
    step's metrics; the optimizer's own step counters are host tensors): halving the token cap
    doubles the micro-batches and adds no read."""
    from dapo_trainer.config import load_config
    from dapo_trainer.trainer import DAPOTrainer
    from tests.trainer.tiny import micro_setup

    base = micro_setup(str(tmp_path)) + ["trainer.val_before_train=false"]
    counts, micro = {}, {}
    for cap in (24, 12):
        trainer = DAPOTrainer(load_config(overrides=base + [f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={cap}"]))
        batch, _ = trainer.generation.collect(1)
        plan, pack = trainer.actor.plan, trainer.actor.pack
        with count_host_syncs() as c:
            def counted_plan(b):
                with c.paused():
                    out = plan(b)
                micro[cap] = sum(len(p.micro) for p in out)
                return out

            def paused_pack(b, rows):
                with c.paused():
                    return pack(b, rows)

            monkeypatch.setattr(trainer.actor, "plan", counted_plan)
            monkeypatch.setattr(trainer.actor, "pack", paused_pack)
            with backend("triton"):  # the path a GPU runs (the CPU path reads its length buckets)
                metrics = trainer.actor.update(batch)
        counts[cap] = c.count
        assert metrics["actor/num_updates"] == 1
        print(f"token cap {cap}: {micro[cap]} micro-batches, {c.count} reads")
    assert micro[12] > micro[24] >= 2, micro
    assert counts[12] == counts[24], c.report()
