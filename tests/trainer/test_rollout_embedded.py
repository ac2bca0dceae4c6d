"""Embedded KV-cache sampler: greedy vs full recomputation, sampling statistics, seeds,
stops, grouping, log-prob agreement with ``dk.linear_log_probs``, weight sync, bad input."""
from __future__ import annotations

import math

import pytest
import torch

from dapo_trainer.model import FULL, SLIDING, ModelConfig, Transformer
from dapo_trainer.rollout import FINISH_LENGTH, FINISH_STOP, RolloutConfig, make_rollout, naive_generate
from dapo_trainer.rollout.embedded import request_keys, sample_tokens, vocab_uniforms
from tests.trainer.rollout_checks import V, check_layout, random_prompts, recomputed_log_probs


def tiny_model(std: float = 0.3, vocab: int = V, **kw) -> Transformer:
    cfg = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
               head_dim=16, max_position_embeddings=128)
    cfg.update(kw)
    return Transformer(ModelConfig(**cfg)).init_weights(std=std).eval()


pytestmark = pytest.mark.usefixtures("one_thread")


# Family switches on the tiny model; windows of 4 are shorter than prompt + response.
FAMILIES = {
    "llama": {},
    "qwen3": dict(qk_norm=True, head_dim=24, tie_word_embeddings=True, model_type="qwen3"),
    "mistral": dict(sliding_window=4, model_type="mistral"),
    "gemma3": dict(qk_norm=True, norm_unit_offset=True, hidden_act="gelu_pytorch_tanh", embed_scale=True,
                   sandwich_norms=True, query_pre_attn_scalar=24, sliding_window=4, layer_types=(SLIDING, FULL),
                   rope_theta=1e6, rope_local_theta=1e4, tie_word_embeddings=True, model_type="gemma3_text"),
    "softcap": dict(attn_logit_softcapping=0.5, sliding_window=4),
    # Layer 0 sparse (6 experts, top-2, renormalised), layer 1 dense (mlp_only_layers).
    "qwen3-moe": dict(qk_norm=True, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, mlp_only_layers=(1,), model_type="qwen3_moe"),
}


@pytest.fixture
def model(request):
    """The tiny model (Llama; a family of FAMILIES when parametrized indirectly)."""
    return tiny_model(**FAMILIES[getattr(request, "param", "llama")])


@pytest.fixture
def engine(model):
    return make_rollout(RolloutConfig(name="embedded"), model)


@pytest.mark.parametrize("model", list(FAMILIES), indirect=True)
def test_greedy_matches_argmax_of_full_recomputation(model, engine):
    prompts = random_prompts(5)
    out = engine.generate(prompts, 2, 12, temperature=0.0)
    check_layout(out, 5, 2, 12)
    # Causal: the argmax of the full forward over prompt + response at each position is
    # what step-by-step recomputation would pick.
    ids, cu, mask = out.sequences()
    with torch.no_grad():
        greedy = model.logits(model(ids, cu, int((cu[1:] - cu[:-1]).max()))).argmax(-1)
    assert torch.equal(greedy[:-1][mask[1:]], out.response_ids)
    assert out.finish_reasons == [FINISH_LENGTH] * 10
    ref = naive_generate(model, prompts, 2, 12, temperature=0.0)
    assert torch.equal(ref.response_ids, out.response_ids)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.8)], ids=["T1", "T0.7-p0.8"])
def test_sampling_equals_naive_loop_with_same_seed(model, engine, temperature, top_p):
    prompts = random_prompts(4)
    stops = tuple(range(0, V, 7))  # responses end at various steps: exercises batch compaction
    out = engine.generate(prompts, 3, 16, temperature=temperature, top_p=top_p, seed=11, stop_token_ids=stops)
    ref = naive_generate(model, prompts, 3, 16, temperature=temperature, top_p=top_p, seed=11, stop_token_ids=stops)
    assert torch.equal(out.lengths, ref.lengths) and torch.equal(out.response_ids, ref.response_ids)
    assert out.finish_reasons == ref.finish_reasons
    assert (out.log_probs - ref.log_probs).abs().max() < 1e-4


@pytest.mark.parametrize("model", list(FAMILIES), indirect=True)
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.6, 1.0), (1.3, 0.7), (0.0, 1.0)],
                         ids=["T1", "T0.6", "T1.3-p0.7", "greedy"])
def test_log_probs_agree_with_linear_log_probs(model, engine, temperature, top_p):
    prompts = random_prompts(6)
    out = engine.generate(prompts, 4, 20, temperature=temperature, top_p=top_p, seed=3)
    # Temperature-scaled, no top-p renormalisation; greedy reports temperature 1.
    lp, *_ = recomputed_log_probs(model, out, temperature or 1.0)
    diff = (lp - out.log_probs).abs()
    assert diff.mean() < 1e-4 and diff.max() < 1e-3, f"mean {diff.mean():.2e} max {diff.max():.2e}"


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty upper quantile of chi-square(df); z = 3.719 is p = 1e-4."""
    a = 2.0 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def chi2_stat(counts: torch.Tensor, probs: torch.Tensor, total: int):
    """Pearson statistic with bins of expected count < 5 merged; returns (stat, dof)."""
    exp = probs.double() * total
    small = exp < 5
    obs, ex = counts[~small].double(), exp[~small]
    if small.any():
        obs = torch.cat([obs, counts[small].sum().double()[None]])
        ex = torch.cat([ex, exp[small].sum()[None]])
    return float(((obs - ex) ** 2 / ex).sum()), len(ex) - 1


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.5, 1.0), (1.0, 0.6)], ids=["T1", "T0.5", "p0.6"])
def test_first_token_distribution_is_the_softmax(temperature, top_p):
    model = tiny_model(vocab=16)
    prompt = random_prompts(1, vocab=16)

    def last_logits():
        ids = torch.tensor(prompt[0])
        with torch.no_grad():
            return model.logits(model(ids, torch.tensor([0, len(ids)], dtype=torch.int32), len(ids)))[-1].double()

    # Scale the head so that logits / temperature have unit spread: neither flat nor peaked.
    with torch.no_grad():
        model.lm_head.weight.mul_(temperature / last_logits().std().item())
    total = 6000
    out = make_rollout(RolloutConfig(), model).generate(prompt, total, 1, temperature=temperature, top_p=top_p)
    logits = last_logits()
    probs = torch.softmax(logits / temperature, -1)
    if top_p < 1:
        sp, order = probs.sort(descending=True)
        keep = (sp.cumsum(0) - sp) < top_p
        probs = torch.zeros_like(probs).index_put_((order[keep],), sp[keep])
        probs /= probs.sum()
    counts = torch.bincount(out.response_ids, minlength=16)
    assert int(counts[probs == 0].sum()) == 0, "sampled a token outside the top-p nucleus"
    stat, dof = chi2_stat(counts[probs > 0], probs[probs > 0], total)
    assert dof >= 2, "distribution too peaked for a meaningful test"
    assert stat < chi2_critical(dof), f"chi2 {stat:.1f} with {dof} dof"


def test_uniforms_are_uniform_and_keyed():
    keys = request_keys(123, 200)
    u = vocab_uniforms(keys, 5, 0, 100)
    assert u.shape == (200, 100) and bool(((u > 0) & (u < 1)).all())
    counts = torch.histc(u.float(), bins=20, min=0, max=1)
    stat, dof = chi2_stat(counts, torch.full((20,), 0.05), u.numel())
    assert stat < chi2_critical(dof)
    assert not torch.equal(u, vocab_uniforms(keys, 6, 0, 100)) and not torch.equal(keys, request_keys(124, 200))
    assert torch.equal(request_keys(123, 7), keys[:7])
    # A vocabulary shard draws the columns of the whole vocabulary's noise (tensor parallel).
    assert torch.equal(vocab_uniforms(keys, 5, 40, 30), u[:, 40:70])


def test_gumbel_max_never_picks_zero_probability_tokens():
    logits = torch.full((4, 8), -float("inf"))
    logits[:, 3] = 0.0
    logits[2, 5] = 30.0
    tok, lp = sample_tokens(logits, request_keys(0, 4), 0, 1.0, 1.0)
    assert tok.tolist() == [3, 3, 5, 3]
    assert torch.isfinite(lp).all()


def test_seeds_reproduce(model, engine):
    prompts = random_prompts(3)
    a = engine.generate(prompts, 4, 10, seed=7)
    b = engine.generate(prompts, 4, 10, seed=7)
    c = engine.generate(prompts, 4, 10, seed=8)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.log_probs, b.log_probs)
    assert not torch.equal(a.response_ids, c.response_ids)
    # A response depends on (seed, index) only: the first prompt's samples do not change
    # when more prompts join the batch.
    alone = engine.generate(prompts[:1], 4, 10, seed=7)
    assert torch.equal(alone.response_ids, a.response_ids[: int(a.cu_seqlens[4])])
    # seed=None draws from torch's global generator.
    torch.manual_seed(5)
    d = engine.generate(prompts, 4, 10)
    torch.manual_seed(5)
    e = engine.generate(prompts, 4, 10)
    assert torch.equal(d.response_ids, e.response_ids)


def test_samples_of_a_prompt_differ(model, engine):
    out = engine.generate(random_prompts(2), 6, 12, seed=1)
    responses = {tuple(out.response(k)) for k in range(6)}
    assert len(responses) > 1


def test_stop_tokens_and_length(model, engine):
    prompts = random_prompts(4)
    stops = (0, 5, 9, 17)
    out = engine.generate(prompts, 5, 15, seed=2, stop_token_ids=stops)
    check_layout(out, 4, 5, 15)
    for k in range(out.num_responses):
        r = out.response(k)
        hits = [i for i, t in enumerate(r) if t in stops]
        if out.finish_reasons[k] == FINISH_STOP:
            assert hits == [len(r) - 1], "a stopped response must end at its first stop token"
        else:
            assert out.finish_reasons[k] == FINISH_LENGTH and len(r) == 15 and not hits
    everything = engine.generate(prompts, 2, 15, seed=2, stop_token_ids=tuple(range(V)))
    assert everything.lengths.tolist() == [1] * 8 and everything.finish_reasons == [FINISH_STOP] * 8
    nothing = engine.generate(prompts, 2, 15, seed=2, stop_token_ids=())
    assert nothing.lengths.tolist() == [15] * 8 and nothing.finish_reasons == [FINISH_LENGTH] * 8
    single = engine.generate(prompts, 2, 15, seed=2, stop_token_ids=0)
    assert single.num_responses == 8


def test_groups_follow_their_prompts(model, engine):
    # Prompts of very different lengths (1 .. 40) exercise the padded prefill cache.
    prompts = [random_prompts(1, 1)[0], random_prompts(1, 40)[0] + [1] * 20, random_prompts(1, 3)[0]]
    out = engine.generate(prompts, 3, 8, temperature=0.0)
    check_layout(out, 3, 3, 8)
    assert out.prompt_ids == prompts
    # Greedy: the 3 samples of a prompt are identical, and equal a one-prompt run.
    for g, p in enumerate(prompts):
        alone = engine.generate([p], 1, 8, temperature=0.0)
        for j in range(3):
            assert out.response(g * 3 + j) == alone.response(0)


def test_update_weights_switches_policy(model, engine):
    prompts = random_prompts(3)
    before = engine.generate(prompts, 1, 10, temperature=0.0)
    other = tiny_model()
    engine.update_weights(other)
    after = engine.generate(prompts, 1, 10, temperature=0.0)
    assert torch.equal(after.response_ids, naive_generate(other, prompts, 1, 10, temperature=0.0).response_ids)
    # Shared weights: an in-place optimiser step is seen without a sync.
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    stepped = engine.generate(prompts, 1, 10, temperature=0.0)
    assert torch.equal(stepped.response_ids, naive_generate(other, prompts, 1, 10, temperature=0.0).response_ids)
    assert not (torch.equal(before.response_ids, after.response_ids)
                and torch.equal(after.response_ids, stepped.response_ids))


def test_bfloat16_model_log_probs_match_recomputation():
    model = tiny_model().to(torch.bfloat16)
    out = make_rollout(RolloutConfig(), model).generate(random_prompts(3), 2, 10, seed=4)
    lp, *_ = recomputed_log_probs(model, out, 1.0)
    # Same bf16 hidden states up to the decode attention's rounding.
    assert (lp - out.log_probs).abs().mean() < 0.05


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(prompt_ids=[]), ValueError, "at least one prompt"),
    (dict(prompt_ids=[[1, 2], []]), ValueError, r"prompt_ids\[1\] is empty"),
    (dict(prompt_ids=[[1] * 120]), ValueError, "max_model_len"),
    (dict(n=0), ValueError, "n must be >= 1"),
    (dict(n=2.0), TypeError, "n must be an int"),
    (dict(max_new_tokens=0), ValueError, "max_new_tokens must be >= 1"),
    (dict(temperature=-1.0), ValueError, "temperature"),
    (dict(top_p=0.0), ValueError, "top_p"),
    (dict(prompt_ids=[[1, V]]), ValueError, "outside"),
    (dict(prompt_ids=torch.ones(2, 3, dtype=torch.long)), TypeError, "list of lists"),
    (dict(prompt_ids=[[1, 2.5]]), TypeError, r"prompt_ids\[0\]"),
    (dict(seed="x"), TypeError, "seed"),
], ids=["no-prompts", "empty-prompt", "too-long", "n0", "n-float", "max-new0", "neg-temp", "top-p0",
        "bad-token", "tensor-prompts", "float-token", "seed-str"])
def test_bad_input(engine, kwargs, err, match):
    args = dict(prompt_ids=[[1, 2, 3]], n=2, max_new_tokens=10)
    args.update(kwargs)
    with pytest.raises(err, match=match):
        engine.generate(**args)


def test_make_rollout_bad_config(model):
    with pytest.raises(ValueError, match="rollout.name"):
        make_rollout(RolloutConfig(name="sglang"), model)
    with pytest.raises(TypeError, match="RolloutConfig"):
        make_rollout({"name": "embedded"}, model)

    class Section:  # the trainer's own rollout section, duck-typed
        name, n, max_model_len = "embedded", 8, 40

    assert make_rollout(Section(), model).max_model_len == 40
    with pytest.raises(TypeError, match="Transformer"):
        make_rollout(RolloutConfig(), torch.nn.Linear(2, 2))

    class TrainerConfig:
        rollout = RolloutConfig(max_model_len=12)

    eng = make_rollout(TrainerConfig(), model)
    with pytest.raises(ValueError, match="max_model_len=12"):
        eng.generate([[1] * 5], 1, 8)


def test_shares_with_prompt_offset_sample_what_the_whole_batch_samples(model, engine):
    """Data-parallel rollout: shares of a generation batch, each sampled with its
    ``prompt_offset``, give the responses and log-probs of the batch sampled at once."""
    prompts, n = random_prompts(5), 3
    whole = engine.generate(prompts, n, 8, seed=11)
    # Log-probs: computed in batches of other sizes, so equal up to fp32 rounding. Yardstick: the
    # teacher-forced packed recomputation (dk.varlen_attention has no float64). The shares' error
    # norm over all tokens is at most 2x the whole batch's (a max over tokens is one token's
    # rounding luck), with an ulp floor for a whole batch that lands on the recomputation.
    ref, *_ = recomputed_log_probs(model, whole, 1.0)
    bound = 2 * max((whole.log_probs - ref).norm(), torch.finfo(torch.float32).eps * ref.norm())
    for sampler in (engine.generate, lambda *a, **k: naive_generate(engine.model, *a, **k)):
        parts = [sampler(prompts[lo:hi], n, 8, seed=11, prompt_offset=lo) for lo, hi in ((0, 2), (2, 3), (3, 5))]
        assert torch.equal(torch.cat([p.response_ids for p in parts]), whole.response_ids)
        err = (torch.cat([p.log_probs for p in parts]) - ref).norm()
        assert err <= bound, f"{err:.2e} > {bound:.2e}"
        assert sum((p.finish_reasons for p in parts), []) == whole.finish_reasons
    # Without the offset a share would redraw the first prompts' streams.
    assert not torch.equal(engine.generate(prompts[2:3], n, 8, seed=11).response_ids, parts[1].response_ids)
    with pytest.raises(ValueError, match="prompt_offset must be >= 0"):
        engine.generate(prompts, n, 8, seed=11, prompt_offset=-1)


class _SwapAt:
    """An ``interrupt`` hook that loads ``new`` weights into ``model`` in place at its ``at``-th call."""

    def __init__(self, model, new_state, at: int):
        self.model, self.new_state, self.at, self.calls = model, new_state, at, 0

    def __call__(self) -> bool:
        self.calls += 1
        if self.calls != self.at:
            return False
        self.model.load_state_dict(self.new_state)
        return True


@pytest.mark.parametrize("model", ["llama", "mistral"], indirect=True)
def test_interrupted_generation_continues_under_the_new_weights(model, engine):
    """Partial rollout: new weights loaded between decode steps 3 and 4. The KV-cache engine recomputes the
    live responses' caches and continues under them, as the full-recompute reference does with the same
    hook; the first 4 tokens and their log-probs are the old weights' (an uninterrupted run's), and
    the rest differ from it."""
    prompts, stops = random_prompts(3), tuple(range(0, V, 11))
    old, new = {k: v.clone() for k, v in model.state_dict().items()}, tiny_model().state_dict()
    whole = engine.generate(prompts, 2, 12, seed=5, stop_token_ids=stops)
    engine.interrupt = _SwapAt(model, new, at=4)
    out = engine.generate(prompts, 2, 12, seed=5, stop_token_ids=stops)
    assert engine.interrupt.calls >= 4
    model.load_state_dict(old)
    ref = naive_generate(model, prompts, 2, 12, seed=5, stop_token_ids=stops, interrupt=_SwapAt(model, new, at=4))
    assert torch.equal(out.lengths, ref.lengths) and torch.equal(out.response_ids, ref.response_ids)
    assert (out.log_probs - ref.log_probs).abs().max() < 1e-4
    head = lambda o: [(o.response_ids[s:s + min(4, int(n))], o.log_probs[s:s + min(4, int(n))])  # noqa: E731
                      for s, n in zip(o.cu_seqlens[:-1].tolist(), o.lengths)]
    for (ti, li), (tw, lw) in zip(head(out), head(whole)):
        assert torch.equal(ti, tw) and torch.allclose(li, lw, atol=1e-5)
    assert not torch.equal(out.log_probs, whole.log_probs) or not torch.equal(out.lengths, whole.lengths)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sampler_routing_replays_in_the_training_forward(dtype):
    """record_routing: the sampler's expert ids per token and sparse layer (prefill and decode) replayed in
    one packed forward of prompt + response are the experts that forward runs (identical choice; a token the
    sampler never ran keeps the router's own); the rollout-vs-training log-prob mismatch with and without
    the replay is printed (bf16: decode and packed forward round differently, so routing can flip)."""
    torch.manual_seed(5)
    model = tiny_model(std=0.3, qk_norm=True, num_layers=3, num_experts=16, num_experts_per_tok=4,
                       moe_intermediate_size=16, norm_topk_prob=True, mlp_only_layers=(1,),
                       model_type="qwen3_moe").to(dtype)
    engine = make_rollout(RolloutConfig(name="embedded"), model)
    engine.record_routing = True
    out = engine.generate(random_prompts(6), 4, 20, temperature=1.0, seed=3)
    ids, cu, mask = out.sequences()
    routed = out.routed_experts
    assert routed.shape == (ids.shape[0], 2, 4) and routed.dtype == torch.int64
    unrun = (routed < 0).any(-1).any(-1)
    assert bool((routed[~unrun] < 16).all()) and int(unrun.sum()) == out.num_responses  # each response's last token
    assert bool(unrun[out.cu_seqlens[1:].long() + torch.tensor([len(out.prompt_ids[g]) for g in out.group_index])
                      .cumsum(0) - 1].all())
    assert not bool(unrun[~mask].any())  # every prompt token ran at prefill
    mismatch, choice = {}, {}
    for replay in (False, True):
        model.replay_routing([routed[:, layer] for layer in range(2)] if replay else None)
        with model.trace_routing() as traces:
            lp, *_ = recomputed_log_probs(model, out, 1.0)
        model.replay_routing(None)
        ran = torch.stack([t.topk_ids for t in traces], 1)
        choice[replay] = int((ran[~unrun] != routed[~unrun]).any(-1).any(-1).sum())
        mismatch[replay] = (lp - out.log_probs).abs()
    print(f"{dtype}: tokens routed otherwise than by the sampler: {choice[False]} of {int((~unrun).sum())} without "
          f"replay, {choice[True]} with; |log-prob mismatch| mean / max: without "
          f"{mismatch[False].mean():.2e} / {mismatch[False].max():.2e}, with {mismatch[True].mean():.2e} / "
          f"{mismatch[True].max():.2e}")
    assert choice[True] == 0
    bound = 1e-4 if dtype == torch.float32 else 0.05
    assert mismatch[True].mean() < bound and mismatch[True].mean() <= mismatch[False].mean() + bound / 10


def _dialog_contexts(groups: int = 3, n: int = 4, prefix: int = 20):
    """A multi-turn rollout's later-turn prompts: each group's ``n`` contexts open with its prompt, then
    differ (1-6 tokens of their own), plus one unrelated short prompt."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(groups):
        head = torch.randint(0, V, (prefix,), generator=g).tolist()
        out += [head + torch.randint(0, V, (int(torch.randint(1, 7, (), generator=g)),), generator=g).tolist()
                for _ in range(n)]
    return out + [torch.randint(0, V, (5,), generator=g).tolist()]


def test_shared_prefixes_clusters_long_common_prefixes_only():
    """Prompts sharing >= _MIN_SHARED leading tokens form one cluster (prefix: their common part, each keeping
    a token after it); a prompt sharing less is a cluster of its own; too little sharing: None."""
    from dapo_trainer.rollout.embedded import _MIN_SHARED, shared_prefixes

    head = list(range(_MIN_SHARED + 2))
    prompts = [head + [1, 2], head, [5] * 4, head + [3], head[:_MIN_SHARED - 1] + [9, 9, 9]]
    clusters = shared_prefixes(prompts)
    assert sorted((sorted(m), p) for m, p in clusters) == [([0, 1, 3], _MIN_SHARED + 1), ([2], 3), ([4], 17)]
    assert shared_prefixes([[1] * 30, [2] * 30]) is None
    assert shared_prefixes([head + [1], head + [2], [7] * 200]) is None  # would save 18 of 238 tokens


@pytest.mark.parametrize("model", list(FAMILIES), indirect=True)
def test_shared_prefix_prefill_equals_the_whole_prompt_prefill(model, engine):
    """Prompts sharing a prefix, the prefix run once and the rest appended to its copied caches: the same
    last hidden states, keys / values (in every written column) and lengths as each prompt run whole, for
    every family (GQA, sliding windows, soft-capping, qk-norm, MoE)."""
    from dapo_trainer.rollout.embedded import shared_prefixes

    prompts = _dialog_contexts()
    clusters = shared_prefixes(prompts)
    assert clusters is not None and max(len(m) for m, _ in clusters) == 4
    S = max(map(len, prompts)) + 5
    with torch.no_grad():
        h0, c0, n0 = engine._prefill_packed(prompts, S)
        h1, c1, n1 = engine._prefill_shared(prompts, clusters, S)
    assert torch.equal(n0, n1)
    assert (h0 - h1).abs().max() < 1e-5
    written = torch.arange(S)[None, :] < n0[:, None]
    for (k0, v0), (k1, v1) in zip(c0, c1):
        assert k0.shape == k1.shape
        for a, b in ((k0, k1), (v0, v1)):
            assert (a - b).abs().permute(0, 2, 1, 3)[written].max() < 1e-5


def test_later_turn_prompts_generate_as_without_sharing(model, engine, monkeypatch):
    """generate() on prompts sharing a prefix (the shared prefill on) samples the same tokens, with log-probs
    within fp32 rounding, as with the sharing off."""
    import dapo_trainer.rollout.embedded as embedded

    prompts = _dialog_contexts()
    assert embedded.shared_prefixes(prompts) is not None  # the shared prefill serves these prompts
    shared = engine.generate(prompts, 1, 8, seed=7)
    monkeypatch.setattr(embedded, "_MIN_SHARED", 10 ** 6)
    whole = engine.generate(prompts, 1, 8, seed=7)
    assert torch.equal(shared.response_ids, whole.response_ids) and torch.equal(shared.lengths, whole.lengths)
    assert (shared.log_probs - whole.log_probs).abs().max() < 1e-5
