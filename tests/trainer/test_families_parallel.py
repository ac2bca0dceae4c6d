"""Qwen3, Qwen3-MoE, Mistral and Gemma 3 (text) through the parallel layouts: a trainer step at TP=2, FSDP2
(DP=2), PP=2, for the sliding-window families and Qwen3-MoE Ulysses SP=2, for Qwen3-MoE EP=2, equals one
process's.

Tiny random models built by transformers (nothing downloaded, as test_families.py does) with the family
features that parallelism touches: per-head q/k norms (replicated under TP, their partial gradients summed
over the TP group), tied embeddings (vocabulary-parallel under TP, a copy on the last stage under PP), a
``pad_token_id`` (``padding_idx``), a sliding window shorter than the sequences (under SP: attention over
whole sequences of a head shard), Gemma's embedding scale and interleaved sliding / full layers with their
own ropes (a PP stage keeps each layer's type: layer 1, full, is stage 1's only layer), Qwen3-MoE's sparse
layers (replicated under TP, experts sharded by FSDP2, one per PP stage, token shards routed under SP,
experts split over the DP ranks at EP=2; the router load metrics equal one process's too; router replay R2
and R3 at TP=2 and FSDP2, R2 at EP=2).
One spawn of 2 gloo processes runs every scenario (test_pipeline.py's harness): the train batch, the first
step's metrics, every gradient and the updated weights equal one process's within fp32 reduction noise.
A layout a model cannot take is refused at start-up, naming the key (Gemma 3 1B's single KV head at TP=2).
"""
from __future__ import annotations

import os

import pytest
import torch

from dapo_trainer.model import FULL, SLIDING
from dapo_trainer.parallel.pipeline import split_model, stage_keep
from dapo_trainer.hf_io import load_hf_model
from tests.trainer.test_pipeline import PP, RUN, _spawn_and_compare
from tests.trainer.tiny import micro_setup, write_char_tokenizer, write_tiny_model

WINDOW = 4  # prompts of up to 6 tokens + responses of up to 5: the window bites
_SPECIALS = dict(pad_token_id=0, eos_token_id=1, bos_token_id=None)  # the char tokenizer's <pad>, <eos>
FAMILIES = {
    # name: (transformers config class prefix, config kwargs)
    "qwen3": ("Qwen3", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24, tie_word_embeddings=True)),
    "mistral": ("Mistral", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW)),
    "gemma3": ("Gemma3Text", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
        layer_types=[SLIDING, FULL],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}})),
}
# Separate from FAMILIES: its own test, so that the dense families' spawn does not grow.
MOE = {"qwen3-moe": ("Qwen3Moe", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True))}
TP = ["actor_rollout_ref.actor.tensor_model_parallel_size=2"]
LAYOUTS = {"tp2": TP, "fsdp2": ["actor_rollout_ref.actor.strategy=fsdp2"], "pp2": PP,
           "sp2": ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"]}
WINDOWED = ("mistral", "gemma3")  # SP=2 too: the Ulysses attention honours the window


def write_family_model(path: str, family: str, **changes) -> str:
    """A random transformers ``family`` model (config ``changes`` applied) + the char tokenizer at ``path``."""
    from tests.trainer.test_model import make_hf_model

    vocab = write_char_tokenizer(path)
    cls, kw = {**FAMILIES, **MOE}[family]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        hf = make_hf_model(cls, {**kw, **_SPECIALS, "vocab_size": (vocab + 3) // 4 * 4, **changes})
    hf.save_pretrained(path)
    return path


def _setup(root: str, tied: bool = False) -> list:
    base = micro_setup(root) + RUN
    for family in (*FAMILIES, *MOE):
        write_family_model(os.path.join(root, family), family)
    # Gemma 3 1B's attention: 4 query heads, 1 KV head (TP=2 cannot split it).
    write_family_model(os.path.join(root, "gemma3-kv1"), "gemma3", num_key_value_heads=1)
    return base


def _model(root, family: str) -> list:
    return [f"actor_rollout_ref.model.path={root}/{family}"]


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_families_tp2_fsdp2_pp2_sp2_equal_one_process(tmp_path):
    scenarios = {f"{family}-{name}": _model(tmp_path, family) + layout for family in FAMILIES
                 for name, layout in LAYOUTS.items() if name != "sp2" or family in WINDOWED}
    refused = _spawn_and_compare(tmp_path, 2, scenarios, setup=_setup,
                                 refusals={"gemma3-kv1-tp2": _model(tmp_path, "gemma3-kv1") + TP})
    for msgs in refused:
        msg = msgs["gemma3-kv1-tp2"]
        assert msg is not None, "a 1-KV-head model was accepted at TP=2"
        for part in ("num_kv_heads (1) must be divisible by the tensor-parallel size 2",
                     "actor_rollout_ref.actor.tensor_model_parallel_size=2", "gemma3_text"):
            assert part in msg, msg


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_qwen3_moe_tp2_fsdp2_pp2_sp2_equal_one_process(tmp_path):
    """Each layout, and router replay R2 (two epochs: the old-log-prob pass records, the update replays)
    and R3 (the rollout's routing through the all-gathered train batch) at TP=2 and FSDP2, against one
    process with the same settings."""
    moe = _model(tmp_path, "qwen3-moe")
    scenarios = {f"qwen3-moe-{name}": moe + layout for name, layout in LAYOUTS.items()}
    r2 = ["actor_rollout_ref.actor.router_replay.mode=R2", "actor_rollout_ref.actor.ppo_epochs=2"]
    r3 = ["actor_rollout_ref.actor.router_replay.mode=R3", "actor_rollout_ref.actor.ppo_epochs=2",
          "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"]
    for mode, extra in (("r2", r2), ("r3", r3)):
        scenarios.update({f"qwen3-moe-{mode}-{name}": moe + extra + LAYOUTS[name] for name in ("tp2", "fsdp2")})
    _spawn_and_compare(tmp_path, 2, scenarios, setup=_setup)


EP = ["actor_rollout_ref.actor.megatron.expert_model_parallel_size=2"]


def _ep_setup(root: str, tied: bool = False) -> list:
    """Qwen3-MoE (4 experts), the same with 3 (EP=2 cannot split them) and dense Qwen3."""
    base = micro_setup(root) + RUN
    for name, family, changes in (("qwen3-moe", "qwen3-moe", {}), ("qwen3-moe-e3", "qwen3-moe", {"num_experts": 3}),
                                  ("qwen3", "qwen3", {})):
        write_family_model(os.path.join(root, name), family, **changes)
    return base


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_qwen3_moe_ep2_equals_one_process(tmp_path):
    """Experts split over the 2 DP ranks (EP=2, tokens exchanged by all-to-all), under DDP, FSDP2 and
    router replay R2 (the replayed ids dispatched): the first step's metrics, every gradient (each rank's
    expert slice gathered) and the updated weights (gathered: the checkpoint's state) equal one process's.
    A dense model and 3 experts over 2 ranks are refused naming the key."""
    moe = _model(tmp_path, "qwen3-moe")
    r2 = ["actor_rollout_ref.actor.router_replay.mode=R2", "actor_rollout_ref.actor.ppo_epochs=2"]
    scenarios = {"qwen3-moe-ep2": moe + EP, "qwen3-moe-ep2-fsdp2": moe + EP + LAYOUTS["fsdp2"],
                 "qwen3-moe-r2-ep2": moe + r2 + EP}
    refusals = {"dense": _model(tmp_path, "qwen3") + EP, "e3": _model(tmp_path, "qwen3-moe-e3") + EP}
    refused = _spawn_and_compare(tmp_path, 2, scenarios, setup=_ep_setup, refusals=refusals)
    for msgs in refused:
        for name, parts in (("dense", ("expert_model_parallel_size=2", "'qwen3' is dense")),
                            ("e3", ("expert_model_parallel_size=2 must divide the number of experts num_experts=3",))):
            assert msgs[name] is not None, f"{name} was accepted at EP=2"
            for part in parts:
                assert part in msgs[name], msgs[name]


@pytest.mark.parametrize("extra, part", [
    (TP, "with actor_rollout_ref.actor.tensor_model_parallel_size=2 is not supported"),
    (["actor_rollout_ref.actor.use_dynamic_bsz=false"], "needs actor_rollout_ref.actor.use_dynamic_bsz=true"),
])
def test_expert_parallel_layouts_it_cannot_take_are_refused_naming_the_key(tmp_path, extra, part):
    from dapo_trainer.config import load_config

    with pytest.raises(ValueError) as e:
        load_config(overrides=micro_setup(str(tmp_path)) + EP + extra)
    assert "actor_rollout_ref.actor.megatron.expert_model_parallel_size" in str(e.value) and part in str(e.value)


def test_expert_parallel_size_must_equal_the_data_parallel_size(tmp_path):
    from dapo_trainer.config import load_config
    from dapo_trainer.parallel import ParallelDims

    cfg = load_config(overrides=micro_setup(str(tmp_path)) + EP)
    with pytest.raises(ValueError, match=r"expert_model_parallel_size=2 must equal the data-parallel size 1 "):
        ParallelDims.build(cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout.n, torch.device("cpu"))


@pytest.mark.parametrize("pp, v", [(2, 1), (2, 2)])
def test_pipeline_stages_keep_each_layers_type(tmp_path, pp, v):
    """Gemma 3 split into pipeline stages: each layer keeps its global index's attention (window or
    full) and rope, so the stages chained give the whole model's hidden states; the types are laid
    out so that a stage rebuilt by its local layer indices would get them wrong."""
    types = (SLIDING, SLIDING, FULL, FULL)
    path = write_tiny_model(str(tmp_path / "gemma3"), layers=4, model_type="gemma3_text", qk_norm=True,
                            norm_unit_offset=True, hidden_act="gelu_pytorch_tanh", embed_scale=True,
                            sandwich_norms=True, query_pre_attn_scalar=24, sliding_window=3, layer_types=types,
                            rope_theta=1e6, rope_local_theta=1e4, tie_word_embeddings=True)
    full = load_hf_model(path)
    chunks = {}
    for rank in range(pp):
        model = load_hf_model(path, keep=stage_keep(rank, pp, v))
        for k, chunk in enumerate(split_model(model, rank, pp, v)):
            chunks[rank + k * pp] = chunk
            for i, layer in chunk.layers.items():
                want = full.layers[i].self_attn.inner_attention.window_size
                assert layer.self_attn.inner_attention.window_size == want, (rank, k, i)
    cu = torch.tensor([0, 9, 16, 17], dtype=torch.int32)
    ids = torch.randint(0, full.config.vocab_size, (17,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = full(ids, cu, 9)
        h = ids
        for s in range(pp * v):
            h = chunks[s](h, cu.reshape(1, -1), torch.tensor([9]))
    assert (h - want).abs().max() <= 1e-6
