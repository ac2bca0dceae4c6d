"""The memory model under pipeline parallelism: per-stage parameters equal the real stage split's,
micro-batches in flight follow the schedules measured in benchmarks/bench_pipeline.py, a model that
does not fit one device fits two stages, PP=1 is the model without stages; dapo-tune weighs PP."""
import os

import pytest

import dapo_trainer
from dapo_trainer.model import ModelConfig, Transformer
from dapo_trainer.parallel.pipeline import split_model
from dapo_trainer.tools import tune
from dapo_trainer.memory_model import Parallel, in_flight, stage_memory, stage_params, train_memory

PRESETS = os.path.join(os.path.dirname(dapo_trainer.__file__), "configs", "presets")


def _cfg(tied=False, layers=4):
    return ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=layers, num_heads=4,
                       num_kv_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=tied)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("pp", [1, 2, 4])
def test_stage_params_equal_the_real_split(pp, tied):
    """Each pipeline rank's parameter count is what split_model leaves on it (a tied embedding's
    copy on the last stage counted there)."""
    cfg = _cfg(tied)
    for rank in range(pp):
        model = Transformer(cfg)
        if pp > 1:
            split_model(model, rank, pp)
        real = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        assert stage_params(cfg, pp, rank) == real, (pp, rank)


def test_in_flight_matches_the_measured_schedules():
    """1F1B: rank i of p holds p - i micro-batches; interleaved (v=2) the bench_pipeline.py figures."""
    assert [in_flight(4, 1, r, 8) for r in range(4)] == [4, 3, 2, 1]
    assert [in_flight(4, 2, r, 8) for r in range(4)] == [5.5, 4.5, 3.5, 2.5]
    assert [in_flight(4, 2, r, 4) for r in range(4)] == [4, 4, 3.5, 2.5]
    assert [in_flight(2, 2, r, 4) for r in range(2)] == [2.5, 1.5]


def test_two_stages_fit_where_one_device_does_not():
    """States and the loss split over two stages: a budget one device exceeds, each stage meets;
    the first stage holds as many layers' activations as the whole model (p micro-batches of L/p)."""
    cfg = ModelConfig(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_layers=8, num_heads=8,
                      num_kv_heads=8, head_dim=128, max_position_embeddings=4096)
    one = train_memory(cfg, 2048, micro_batches=2)
    two = [stage_memory(cfg, 2048, r, par=Parallel(pp=2), micro_batches=2) for r in range(2)]
    budget = 0.75 * one["peak"]
    assert one["peak"] > budget and max(m["peak"] for m in two) <= budget
    assert train_memory(cfg, 2048, par=Parallel(pp=2), micro_batches=2)["peak"] == max(m["peak"] for m in two)
    full = train_memory(cfg, 2048, checkpointing=True, micro_batches=2)
    first = stage_memory(cfg, 2048, 0, checkpointing=True, par=Parallel(pp=2), micro_batches=2)
    assert first["loss"] == 0 and first["pipe"] > 0 and two[1]["loss"] == one["loss"]
    assert abs(first["activations"] - full["activations"]) < 0.05 * full["activations"]  # the norm's 3 H


def test_pp1_is_the_model_without_stages():
    """PP=1: stage 0 is the whole model, no pipe buffers; bad stage counts are refused by name."""
    cfg = _cfg()
    m = train_memory(cfg, 512, micro_batches=2)
    assert m["pipe"] == 0 and m["stage"] == 0 and stage_params(cfg) == cfg.num_params()
    with pytest.raises(ValueError, match="par.pp=3"):
        stage_params(cfg, 3)
    with pytest.raises(ValueError, match="micro_batches=2 must be >= par.pp x par.vpp = 4"):
        train_memory(cfg, 512, par=Parallel(pp=2, vpp=2), micro_batches=2)


def test_tune_weighs_pipeline_stages():
    """Qwen2.5-32B on 8 x 80 GB: no layout fits, and the refusal states each stage count's largest
    stage (the sampler replica every pipeline rank keeps and the embedding's stage make PP no smaller
    than FSDP over all 8 devices); 7B keeps FSDP2 without a PP key."""
    with pytest.raises(ValueError, match=r"at pipeline_model_parallel_size=2 \d+\.\d GiB on its largest stage"):
        tune.tune("math", "8xH100", os.path.join(PRESETS, "models", "qwen2.5-32b"))
    v = {k: x for k, x, _ in tune.tune("math", "8xH100", os.path.join(PRESETS, "models", "qwen2.5-7b"))}
    assert v["actor_rollout_ref.actor.strategy"] == "fsdp2"
    assert "actor_rollout_ref.actor.pipeline_model_parallel_size" not in v


def test_fsdp_gathered_units_per_stage():
    """FSDP2's unsharded working set: none without FSDP (the PP=1 single-device figures unchanged);
    under FSDP the root (embedding + lm_head, one tied copy) and two layers' parameters plus one
    layer's fp32 gradient, whatever the shard count; pipeline stages split the root between them."""
    cfg = _cfg()
    H, V = cfg.hidden_size, cfg.vocab_size
    layer = (cfg.num_params(embeddings=False) - H) / cfg.num_layers
    assert train_memory(cfg, 512, micro_batches=2)["gathered"] == 0
    for fsdp in (2, 8):
        m = stage_memory(cfg, 512, par=Parallel(fsdp=fsdp), micro_batches=2)
        assert m["gathered"] == (2 * V * H + H) * 4 + 2 * layer * 4 + 4 * layer
    tied = stage_memory(_cfg(tied=True), 512, par=Parallel(fsdp=2), micro_batches=2)
    assert tied["gathered"] == (V * H + H) * 4 + 2 * layer * 4 + 4 * layer
    first, last = (stage_memory(cfg, 512, r, par=Parallel(fsdp=2, pp=2), micro_batches=2)["gathered"] for r in (0, 1))
    assert first == V * H * 4 + 12 * layer and last == (V * H + H) * 4 + 12 * layer
