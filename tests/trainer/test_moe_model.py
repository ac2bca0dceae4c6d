"""Qwen3-MoE in the trainer beyond the parity tests of test_families.py: the router's aux loss against
transformers' (value and router gradient), routing traces (the forward's only, not activation
checkpointing's recompute), router replay (the replayed experts are the ones run, through a checkpointed
backward too), the aux-loss coefficient acting in a DAPO step, and bad config.json values named."""
from __future__ import annotations

import os

import pytest
import torch

import dapo_kernels as dk
from dapo_trainer import config_from_hf, load_hf_model, read_hf_config
from dapo_trainer.config import load_config
from dapo_trainer.router_load import RouterLoad
from dapo_trainer.trainer import DAPOTrainer
from tests.tolerance import rel_err
from tests.trainer.test_model import make_hf_model, random_batch
from tests.trainer.tiny import micro_setup, write_tiny_model

MOE = dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6,
           num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(transformers Qwen3MoeForCausalLM, its save_pretrained dir): sparse layers 0 and 2."""
    torch.manual_seed(0)
    hf = make_hf_model("Qwen3Moe", MOE)
    path = str(tmp_path_factory.mktemp("qwen3moe"))
    hf.save_pretrained(path)
    return hf, path


def _traced(model, packed, cu, S):
    with model.trace_routing() as traces:
        hidden = model(packed, cu, S)
    return hidden, traces


def test_aux_loss_and_its_router_gradient_match_transformers(checkpoint):
    """RouterLoad.add's loss (all sparse layers' logits at once) is transformers' aux_loss
    (output_router_logits=True, padding masked), and so are the router weights' gradients of it."""
    hf, path = checkpoint
    torch.manual_seed(1)
    ids, mask, packed, cu, S = random_batch([7, 1, 19, 12])
    hf.zero_grad()
    theirs = hf(input_ids=ids, attention_mask=mask.long(), output_router_logits=True).aux_loss
    theirs.backward()
    model = load_hf_model(path)
    _, traces = _traced(model, packed, cu, S)
    assert [t.layer for t in traces] == [0, 2]
    load = RouterLoad(2, 6, 2, torch.device("cpu"))
    ours = load.add(traces)
    ours.backward()
    err = rel_err(ours.detach(), theirs.detach())
    gate_err = max(rel_err(model.layers[str(i)].mlp.gate.weight.grad, hf.model.layers[i].mlp.gate.weight.grad)
                   for i in (0, 2))
    print(f"aux loss {float(ours.detach()):.6f} vs transformers {float(theirs.detach()):.6f}: rel err {err:.2e}; "
          f"router gradient max rel err {gate_err:.2e}")
    assert err < 1e-6 and gate_err < 1e-5
    # Load: every (token, choice) pair counted once per sparse layer.
    assert load.counts.sum(1).tolist() == [2.0 * len(packed)] * 2
    m = load.metrics()
    assert m["actor/moe_load_max"] >= 1.0 >= m["actor/moe_load_min"]
    assert abs(m["actor/moe_aux_loss"] - float(ours.detach())) < 1e-6


def test_traces_record_the_forward_not_the_recompute(checkpoint):
    """With activation checkpointing the backward recomputes each layer: nothing more is traced, and the
    gradients equal those without checkpointing."""
    _, path = checkpoint
    torch.manual_seed(2)
    _, _, packed, cu, S = random_batch([9, 14])
    grads = []
    for ckpt in (False, True):
        model = load_hf_model(path)
        model.activation_checkpointing = ckpt
        hidden, traces = _traced(model, packed, cu, S)
        model.logits(hidden).square().mean().backward()
        assert len(traces) == 2
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert max(rel_err(grads[1][n], g) for n, g in grads[0].items()) < 1e-6
    with torch.no_grad():
        model(packed, cu, S)  # outside trace_routing: no sink left behind
    assert all(b.sink is None for b in model.sparse_blocks())


def test_replayed_routing_is_the_routing_run(checkpoint):
    """replay_routing(ids): each sparse layer runs exactly those experts (its trace says so and the output
    is moe_experts' with the router's probabilities of them); replaying a forward's own routing gives
    its output bit for bit; the replay holds through a checkpointed backward; None ends it."""
    _, path = checkpoint
    model = load_hf_model(path)
    torch.manual_seed(3)
    _, _, packed, cu, S = random_batch([11, 6])
    with torch.no_grad():
        free, traces = _traced(model, packed, cu, S)
        recorded = [t.topk_ids for t in traces]
        model.replay_routing(recorded)
        same, again = _traced(model, packed, cu, S)
    assert torch.equal(same, free) and all(torch.equal(a.topk_ids, t) for a, t in zip(again, recorded))
    # Other experts: the reverse choice order shifted by one expert.
    other = [(t.flip(1) + 1) % 6 for t in recorded]
    assert all((o != t).any() for o, t in zip(other, recorded))
    model.replay_routing(other)
    model.activation_checkpointing = True
    hidden, replayed = _traced(model, packed, cu, S)
    assert all(torch.equal(r.topk_ids, o) for r, o in zip(replayed, other))
    block = model.layers["0"].mlp
    x = torch.randn(4, model.config.hidden_size)
    block.replay = other[0][:4]
    logits = block.gate(x)
    probs = torch.softmax(logits, -1).gather(1, other[0][:4])
    want = dk.moe_experts(x, block.experts.gate_up_proj, block.experts.down_proj, probs / probs.sum(1, keepdim=True),
                          other[0][:4])
    assert rel_err(block(x).detach(), want.detach()) < 1e-6
    block.replay = other[0]
    hidden.sum().backward()  # the recompute routes by the replayed ids (else checkpoint's shapes match but
    ref = load_hf_model(path)  # the values differ): the gradients are those of a replayed forward without it
    ref.replay_routing(other)
    ref(packed, cu, S).sum().backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}  # lm_head: unused
    assert ref_grads.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    assert max(rel_err(model.get_parameter(n).grad, g) for n, g in ref_grads.items()) < 1e-6
    model.replay_routing(None)
    with torch.no_grad():
        _, traces = _traced(model, packed, cu, S)
    assert all(torch.equal(t.topk_ids, r) for t, r in zip(traces, recorded))
    with pytest.raises(ValueError, match="expert ids for 1 layers, the model holds 2 sparse layers"):
        model.replay_routing(recorded[:1])


def test_aux_loss_coef_acts_in_a_step(tmp_path):
    """actor.router_aux_loss_coef > 0 adds the aux loss: the routers move otherwise than without it (the
    same run with coef 0 twice moves them identically)."""
    family = dict(model_type="qwen3_moe", qk_norm=True, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=16, norm_topk_prob=False)
    gates = {}
    for run, coef in (("a", 0.0), ("b", 0.0), ("c", 1.0)):
        root = os.path.join(tmp_path, run)
        overrides = micro_setup(root) + ["trainer.total_training_steps=1", "trainer.val_before_train=false",
                                         "data.val_files=[]", "trainer.save_freq=1",
                                         f"actor_rollout_ref.actor.router_aux_loss_coef={coef}"]
        write_tiny_model(os.path.join(root, "model"), layers=2, **family)
        DAPOTrainer(load_config(overrides=overrides)).fit()
        saved = load_hf_model(os.path.join(root, "run", "checkpoints", "global_step_1", "model"))
        gates[run] = torch.cat([b.gate.weight.reshape(-1) for b in saved.sparse_blocks()])
    assert torch.equal(gates["a"], gates["b"])
    assert not torch.allclose(gates["a"], gates["c"])


@pytest.mark.parametrize("changes, message", [
    (dict(num_experts=0), "num_experts must be an int >= 1"),
    (dict(num_experts_per_tok=7), r"num_experts_per_tok \(7\) must be <= num_experts \(6\)"),
    (dict(moe_intermediate_size=None), "moe_intermediate_size must be an int >= 1"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step must be an int >= 1"),
    (dict(mlp_only_layers="1"), "mlp_only_layers must be a list of layer indices"),
], ids=["experts-0", "topk-above-experts", "no-moe-size", "sparse-step-0", "mlp-only-str"])
def test_bad_moe_config_is_named(changes, message):
    base = dict(model_type="qwen3_moe", vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=8)
    with pytest.raises(ValueError, match=f"config.json: {message}"):
        config_from_hf({**base, **changes})


def test_release_and_transformers5_dialects_agree(checkpoint):
    """Released configs say num_experts, transformers 5 writes num_local_experts: one ModelConfig."""
    _, path = checkpoint
    cfg = read_hf_config(path)
    d = dict(cfg.hf_config)
    assert "num_local_experts" in d
    d["num_experts"] = d.pop("num_local_experts")
    assert config_from_hf(d) == cfg and cfg.num_experts == 6 and [cfg.is_moe(i) for i in range(3)] == [1, 0, 1]


def test_r2_replays_the_old_log_prob_forwards_routing(tmp_path, monkeypatch):
    """router_replay.mode=R2, two epochs (off-policy: an old-log-prob pass runs): every training forward
    (grad enabled) routes each sparse layer by the expert ids the old-log-prob forward (no grad) chose for
    the same micro-batch; without R2 no forward replays."""
    from dapo_trainer.model import SparseMoeBlock

    calls = []  # (grad enabled, layer, replayed ids or None, the router's own top-k ids)
    forward = SparseMoeBlock.forward

    def spy(self, x):
        own = dk.moe_route(self.gate(x).detach(), self.top_k, self.norm_topk_prob)[1]
        calls.append((torch.is_grad_enabled(), self.layer, self.replay, own))
        return forward(self, x)

    monkeypatch.setattr(SparseMoeBlock, "forward", spy)
    family = dict(model_type="qwen3_moe", qk_norm=True, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=16, norm_topk_prob=True)
    replayed = {}
    for mode in ("disabled", "R2"):
        root = os.path.join(tmp_path, mode)
        overrides = micro_setup(root) + ["trainer.total_training_steps=1", "trainer.val_before_train=false",
                                         "data.val_files=[]", "actor_rollout_ref.actor.ppo_epochs=2",
                                         "actor_rollout_ref.model.enable_gradient_checkpointing=true",
                                         f"actor_rollout_ref.actor.router_replay.mode={mode}"]
        write_tiny_model(os.path.join(root, "model"), layers=2, **family)
        trainer = DAPOTrainer(load_config(overrides=overrides))
        calls.clear()
        trainer.fit()
        training = [c for c in calls if c[0]]
        assert training, "no training forward seen"
        replayed[mode] = [c for c in training if c[2] is not None]
        if mode == "R2":
            # The old-log-prob forwards: no grad, after sampling; their own choices per layer, in order.
            recorded = {}
            for grad, layer, replay, own in calls:
                if not grad and replay is None:
                    recorded.setdefault(layer, []).append(own)
            for grad, layer, replay, own in training:
                assert replay is not None, "a training forward routed by its own router under R2"
                assert any(r.shape == replay.shape and torch.equal(r, replay) for r in recorded[layer]), layer
    assert not replayed["disabled"] and len(replayed["R2"]) >= 2 * 2  # 2 sparse layers, 2 epochs


def test_r3_replays_the_rollouts_routing(tmp_path, monkeypatch):
    """router_replay.mode=R3 (+ rollout.enable_rollout_routing_replay), two epochs: the old-log-prob
    forwards and every training forward route each sparse layer by the sampler's recorded expert ids
    (TrainBatch.routed_experts packed with the micro-batch); before the first update the policy is the
    sampler's, so its own top-k agrees with them on every token the sampler ran (-1 rows: the rest)."""
    from dapo_trainer.model import SparseMoeBlock

    calls = []  # (grad enabled, replayed ids or None, the router's own top-k ids)
    forward = SparseMoeBlock.forward

    def spy(self, x):
        own = dk.moe_route(self.gate(x).detach(), self.top_k, self.norm_topk_prob)[1]
        calls.append((torch.is_grad_enabled(), self.replay, own))
        return forward(self, x)

    monkeypatch.setattr(SparseMoeBlock, "forward", spy)
    root = str(tmp_path)
    overrides = micro_setup(root) + ["trainer.total_training_steps=1", "trainer.val_before_train=false",
                                     "data.val_files=[]", "actor_rollout_ref.actor.ppo_epochs=2",
                                     "actor_rollout_ref.actor.router_replay.mode=R3",
                                     "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"]
    write_tiny_model(os.path.join(root, "model"), layers=2, model_type="qwen3_moe", qk_norm=True, num_experts=4,
                     num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)
    trainer = DAPOTrainer(load_config(overrides=overrides))
    batch, _ = trainer.generation.collect(1)
    assert batch.routed_experts.shape[1] == (6 + 5) * 2 * 2  # (max prompt + max response) x 2 layers x top-2
    calls.clear()
    trainer.actor.update(batch)
    replayed = [c for c in calls if c[1] is not None]
    old = [c for c in replayed if not c[0]]
    assert old and all(c[1] is not None for c in calls), "a forward of the update routed by its own router"
    for _, replay, own in old:  # the old-log-prob pass precedes any update: the sampler's policy
        ran = (replay >= 0).all(1)
        assert torch.equal(own[ran], replay[ran]) and 0 < int((~ran).sum()) <= batch.prompt_len.shape[0]


def test_router_replay_refusals(tmp_path):
    """Router replay settings that cannot work are refused at load naming the key; R2 / R3 on a dense
    model at start-up."""
    base = micro_setup(str(tmp_path))
    key, rec = "actor_rollout_ref.actor.router_replay.mode", "actor_rollout_ref.rollout.enable_rollout_routing_replay"
    with pytest.raises(ValueError, match=f"{rec}.*only for it: got false with 'R3'"):
        load_config(overrides=base + [f"{key}=R3"])
    with pytest.raises(ValueError, match=f"{rec}.*only for it: got true with 'R2'"):
        load_config(overrides=base + [f"{key}=R2", f"{rec}=true"])
    r3 = [f"{key}=R3", f"{rec}=true"]
    with pytest.raises(ValueError, match=f"{key}.*'R3' needs the embedded sampler"):
        load_config(overrides=base + r3 + ["actor_rollout_ref.rollout.name=vllm"])
    with pytest.raises(ValueError, match=f"{key}.*'R3' with sequence parallelism"):
        load_config(overrides=base + r3 + ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"])
    with pytest.raises(ValueError, match=f"{key}.*pipeline parallelism"):
        load_config(overrides=base + [f"{key}=R2", "actor_rollout_ref.actor.pipeline_model_parallel_size=2"])
    for mode in (["R2"], r3):
        with pytest.raises(ValueError, match=f"{key}.*model_type 'llama' has no sparse layer"):
            DAPOTrainer(load_config(overrides=base + ([f"{key}=R2"] if mode == ["R2"] else r3)))


def test_vllm_sync_names_are_the_checkpoints(checkpoint):
    """hf_weights (the vLLM sync's stream) yields the names and tensors transformers' save_pretrained
    wrote: experts per expert, gate / up split from the stacked weight."""
    from safetensors import safe_open

    from dapo_trainer.rollout.vllm_engine import hf_weights

    _, path = checkpoint
    ours = dict(hf_weights(load_hf_model(path)))
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        theirs = {k: f.get_tensor(k) for k in f.keys()}
    assert ours.keys() == theirs.keys() and "model.layers.0.mlp.experts.5.up_proj.weight" in ours
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
