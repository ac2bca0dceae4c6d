"""Multi-turn rollouts: masks exclude every environment token (random dialogues, with
and without a chat template), the fused loss on a multi-turn batch equals a float64 reference that
applies the mask, environment errors name the environment and the conversation without losing the
other samples, environments load by file and dotted path, and a micro run trains through one."""
import json
import os
import random
import sys

import pytest
import torch

import dapo_kernels as dk
from dapo_trainer.config import load_config
from dapo_trainer.data import load_tokenizer
from dapo_trainer.envs import EnvironmentError_, load_environment
from dapo_trainer.rollout import RolloutConfig, make_rollout
from dapo_trainer.rollout.multiturn import multi_turn_rollout
from dapo_trainer.actor import pack_micro_batch
from dapo_trainer.trainer import DAPOTrainer
from tests.tolerance import assert_close_to_ref
from tests.trainer.tiny import micro_setup, train_batch, write_tiny_model

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
ALPHA = "abcdefghij0123456789 "


class RandomEnv:
    """Random openings, random replies of random length, random ends; components per step."""

    name = "random-env"

    def __init__(self, seed=0, p_done=0.3):
        self.rng, self.p_done = random.Random(seed), p_done

    def _text(self, lo=1, hi=6):
        return "".join(self.rng.choice(ALPHA) for _ in range(self.rng.randint(lo, hi)))

    def reset(self, row):
        return [{"role": "system", "content": self._text()}, {"role": "user", "content": row["prompt"]}]

    def step(self, history):
        assert history[-1]["role"] == "assistant"
        msg = None if self.rng.random() < self.p_done else {"role": "user", "content": self._text()}
        return msg, {"score": float(len(history) % 3), "acc": 1.0}


class Recording:
    """An engine wrapper that logs every generate call's contexts and samples."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []
        self.max_model_len = engine.max_model_len

    def generate(self, prompts, n, max_new, **kw):
        out = self.engine.generate(prompts, n, max_new, **kw)
        self.calls.append(([list(p) for p in prompts], n, out))
        return out


def _model_dir(tmp_path, chat: bool) -> str:
    path = write_tiny_model(str(tmp_path / "model"), hidden=32, layers=1, seed=random.randrange(100))
    if chat:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])  # ids inside the model's padded vocabulary
        tok.save(os.path.join(path, "tokenizer.json"))
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            json.dump({"eos_token": "<|im_end|>", "pad_token": "<pad>", "chat_template": CHATML}, f)
    # More stop tokens, so that the random model ends its turns early and dialogues go on.
    tok = load_tokenizer(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [tok.eos_token_id] + [tok.tok.token_to_id(ch) for ch in "abcd"]}, f)
    return path


def _rollout(tmp_path, chat, env, n=3, rows=4, **kw):
    from dapo_trainer.hf_io import load_hf_model

    path = _model_dir(tmp_path, chat)
    tok = load_tokenizer(path)
    engine = Recording(make_rollout(RolloutConfig(name="embedded"), load_hf_model(path)))
    data = [{"prompt": "".join(random.choice(ALPHA) for _ in range(random.randint(1, 5))), "ground_truth": "",
             "data_source": "t", "extra_info": {}} for _ in range(rows)]
    args = dict(max_prompt_length=40, max_response_length=60, max_turns=4, max_turn_tokens=8, seed=5)
    args.update(kw)
    return tok, engine, data, multi_turn_rollout(engine, tok, env, data, n, **args)


@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat-template"])
def test_masks_exclude_every_environment_token(tmp_path, chat):
    env = RandomEnv(seed=random.randrange(10**6))
    tok, engine, data, out = _rollout(tmp_path, chat, env)
    n = out.n
    # What the engine sampled for each conversation, in call order.
    sampled = {k: [] for k in range(out.num_responses)}
    contexts = {k: [] for k in range(out.num_responses)}
    for i, (prompts, cn, o) in enumerate(engine.calls):
        if i == 0:
            members = list(range(out.num_responses))
        else:  # later turns: one context per live conversation; find it by its tokens and by what
            # was sampled after them (two conversations with the same context so far are told
            # apart by their continuation; with the same continuation too they are interchangeable)
            members = []
            for j, p in enumerate(prompts):
                got = o.response_ids[int(o.cu_seqlens[j]):int(o.cu_seqlens[j + 1])].tolist()[:8]
                def continues(c, L):  # (the turn may have been cut to the conversation's budget)
                    kept = c.tokens[L:L + len(got)]
                    return kept == got[:len(kept)]
                k = next(k for k, c in enumerate(out.conversations)
                         if k not in members and out.prompt_ids[k // n] + c.tokens[:len(p) - c.prompt_len] == p
                         and continues(c, len(p) - c.prompt_len))
                members.append(k)
        for j, k in enumerate(members):
            s, e = int(o.cu_seqlens[j]), int(o.cu_seqlens[j + 1])
            sampled[k].append((o.response_ids[s:e].tolist(), o.log_probs[s:e].tolist()))
            contexts[k].append(prompts[j // cn] if i == 0 else prompts[j])
    assert any(c.num_turns > 1 for c in out.conversations), "the random dialogues never went past one turn"
    for k, c in enumerate(out.conversations):
        s, e = int(out.cu_seqlens[k]), int(out.cu_seqlens[k + 1])
        ids, mask, lps = out.response_ids[s:e], out.response_mask[s:e], out.log_probs[s:e]
        # The masked tokens are exactly the sampled turns, in order, each cut to the turn's cap: 8
        # tokens, or what is left of the response budget (only the last turn can hit that).
        kept = [n_ for r, n_ in c.turn_lengths if r == "assistant"]
        assert len(kept) == len(sampled[k])
        assert all(m == min(8, len(toks)) for (toks, _), m in zip(sampled[k][:-1], kept[:-1]))
        assert kept[-1] <= min(8, len(sampled[k][-1][0]))
        want = [t for (toks, _), m in zip(sampled[k], kept) for t in toks[:m]]
        assert ids[mask].tolist() == want
        assert torch.allclose(lps[mask], torch.tensor([x for (_, lp), m in zip(sampled[k], kept) for x in lp[:m]]))
        assert bool((lps[~mask] == 0).all())
        # Every unmasked token is the environment's: turn by turn, env spans alternate with sampled ones.
        pos = 0
        for role, length in c.turn_lengths:
            assert bool(mask[pos:pos + length].all()) if role == "assistant" else not bool(mask[pos:pos + length].any())
            pos += length
        assert pos == len(ids)
        # Each turn's context was the prompt plus the response so far.
        for t, ctx in enumerate(contexts[k]):
            assert ctx[:c.prompt_len] == out.prompt_ids[k // n]
            assert ctx[c.prompt_len:] == ids[:len(ctx) - c.prompt_len].tolist()
        ends = [toks[:8][-1] for toks, _ in sampled[k]]
        # (A random model also samples the template's markers inside its turns, e.g. <|im_start|>;
        # such a turn's text re-tokenises otherwise, so the text check needs plain turns.)
        plain = all(tok.tok.decode(t[:8][:-1], skip_special_tokens=True)
                    == tok.tok.decode(t[:8][:-1], skip_special_tokens=False) for t, _ in sampled[k])
        if chat and c.finish == "stop" and set(ends) == {tok.eos_token_id} and plain:
            # Turns that ended with the template's own end token: the environment tokens are the
            # template's text between the turns.
            text = tok.tok.decode(out.prompt_ids[k // n] + ids.tolist(), skip_special_tokens=False)
            rendered = tok.render_chat(c.messages, add_generation_prompt=False)
            assert rendered.replace(" ", "").startswith(text.replace(" ", ""))
    # The trainer packs the same mask: label t+1 predicted at t only for sampled tokens.
    batch, rows = _batch(out, 40, 60)
    mb = pack_micro_batch(batch, rows, torch.device("cpu"))
    assert int(mb.mask.sum()) == int(out.response_mask.sum())
    assert mb.labels[mb.mask].tolist() == out.response_ids[out.response_mask].tolist()


def _batch(out, P, R):
    N = out.num_responses
    prompt_ids = torch.zeros(N, P, dtype=torch.int64)
    response_ids = torch.zeros(N, R, dtype=torch.int64)
    response_mask = torch.zeros(N, R, dtype=torch.bool)
    plen = torch.zeros(N, dtype=torch.int64)
    for k in range(N):
        p = out.prompt_ids[k // out.n]
        prompt_ids[k, :len(p)], plen[k] = torch.tensor(p), len(p)
        s, e = int(out.cu_seqlens[k]), int(out.cu_seqlens[k + 1])
        response_ids[k, :e - s], response_mask[k, :e - s] = out.response_ids[s:e], out.response_mask[s:e]
    adv = torch.randn(N)
    return (train_batch(prompt_ids=prompt_ids, prompt_len=plen, response_ids=response_ids, response_len=out.lengths,
                        sampled=response_mask, advantages=adv), list(range(N)))


def _masked_loss_ref(hidden, weight, labels, old, adv, ref_lp, mask, cu, mode, T, ec, kc):
    """verl's actor loss written out on the masked positions only (boolean selection, not a product)."""
    logits = (hidden @ weight.T) / T
    logp_all = torch.log_softmax(logits, -1)
    lp = logp_all.gather(1, labels[:, None]).squeeze(1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    ratio = torch.exp(lp - old)
    pg1, pg2 = -adv * ratio, -adv * ratio.clamp(1 - 0.2, 1 + 0.28)
    clip1 = torch.maximum(pg1, pg2)
    pg = torch.where(adv < 0, torch.minimum(-adv * 3.0, clip1), clip1)
    d = ref_lp - lp
    kl = (torch.exp(d) - d - 1).clamp(-10, 10)  # low_var_kl

    def agg(v):
        if mode == "token-mean":
            return v[mask].sum() / mask.sum()
        per_seq = [v[s:e][mask[s:e]] for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())]
        return torch.stack([x.mean() for x in per_seq if len(x)]).sum() / len(per_seq)

    return agg(pg) - ec * agg(ent) + kc * agg(kl)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_fused_loss_on_multiturn_batch_equals_masked_float64_reference(tmp_path, mode):
    _, _, _, out = _rollout(tmp_path, False, RandomEnv(seed=random.randrange(10**6), p_done=0.1))
    batch, rows = _batch(out, 40, 60)
    mb = pack_micro_batch(batch, rows, torch.device("cpu"))
    T, H, V = mb.input_ids.shape[0], 16, 64
    g = torch.Generator().manual_seed(random.randrange(2**31))
    hidden, weight = torch.randn(T, H, generator=g), torch.randn(V, H, generator=g) * 0.5
    labels, mask, cu, adv = mb.labels, mb.mask, mb.cu_seqlens, mb.advantages
    assert bool(mask.any()) and not bool(mask.all())
    old = torch.randn(T, generator=g) * 0.3 - 3.0
    ref_lp = torch.randn(T, generator=g) * 0.3 - 3.0
    kw = dict(temperature=0.7, loss_agg_mode=mode, entropy_coeff=0.01, kl_coef=0.1, kl_type="low_var_kl",
              num_tokens=int(mask.sum()), num_seqs=len(rows), cu_seqlens=cu if mode.startswith("seq") else None)
    loss, _ = dk.fused_linear_policy_loss(hidden, weight, labels, old, adv, mask, ref_log_prob=ref_lp, **kw)

    def ref(dt):
        return _masked_loss_ref(hidden.to(dt), weight.to(dt), labels, old.to(dt), adv.to(dt), ref_lp.to(dt), mask,
                                cu, mode, 0.7, 0.01, 0.1)

    assert_close_to_ref(loss, ref(torch.float64), ref(torch.float32), name="loss")
    # Environment positions are inert: changing their advantages, old / ref log-probs and labels
    # changes nothing.
    env = ~mask
    loss2, _ = dk.fused_linear_policy_loss(
        hidden, weight, torch.where(env, (labels + 1) % V, labels), torch.where(env, old + 5, old),
        torch.where(env, adv * -7, adv), mask, ref_log_prob=torch.where(env, ref_lp - 2, ref_lp), **kw)
    assert torch.equal(loss, loss2)


class Faulty(RandomEnv):
    name = "faulty-env"

    def __init__(self, mode):
        super().__init__(seed=1, p_done=0.0)
        self.mode = mode

    def step(self, history):
        if history[0]["content"].startswith("x"):
            return {"raise": lambda: 1 / 0, "type": lambda: "not a tuple", "empty": lambda: ({"role": "user", "content": ""}, {}),
                    "component": lambda: (None, {"score": "high"})}[self.mode]()
        return super().step(history)

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]


@pytest.mark.parametrize("mode,what", [("raise", "ZeroDivisionError"), ("type", "must return"),
                                       ("empty", "empty turn"), ("component", "component 'score'")])
def test_environment_errors_name_env_and_conversation_and_keep_other_samples(tmp_path, mode, what):
    env = Faulty(mode)
    from dapo_trainer.hf_io import load_hf_model

    path = _model_dir(tmp_path, False)
    tok = load_tokenizer(path)
    engine = make_rollout(RolloutConfig(name="embedded"), load_hf_model(path))
    rows = [{"prompt": p, "ground_truth": "", "data_source": "t", "extra_info": {}} for p in ("ab", "xyz", "cd")]
    args = dict(max_prompt_length=20, max_response_length=30, max_turns=3, max_turn_tokens=5, seed=3)
    with pytest.raises(EnvironmentError_, match=rf"2 of 6 conversations failed.*'faulty-env'.*conversation 2 \(row 1, "
                                                rf"sample 0.*{what}") as ei:
        multi_turn_rollout(engine, tok, env, rows, 2, **args)
    out = ei.value.output
    assert set(out.errors) == {2, 3}
    for k in (0, 1, 4, 5):  # the others ran to the end
        c = out.conversations[k]
        assert c.error is None and c.finish in ("stop", "length") and c.num_turns >= 1
    # on_error="drop" returns the same rollout with the failures flagged (a fresh environment: its
    # random replies are a stream the first rollout has consumed).
    out2 = multi_turn_rollout(engine, tok, Faulty(mode), rows, 2, on_error="drop", **args)
    assert set(out2.errors) == {2, 3} and out2.finish_reasons[2] == "error"
    assert torch.equal(out2.response_ids, out.response_ids)


def test_load_environment_by_file_and_dotted_path(tmp_path):
    f = tmp_path / "my_env.py"
    f.write_text("class Desk:\n    def reset(self, row):\n        return [{'role': 'user', 'content': 'hi'}]\n"
                 "    def step(self, history):\n        return None, {'score': 1.0}\n")
    env = load_environment(str(f), "Desk")
    assert env.reset({}) == [{"role": "user", "content": "hi"}]
    sys.path.insert(0, str(tmp_path))
    try:
        assert type(load_environment("my_env:Desk")).__name__ == "Desk"
        assert type(load_environment("my_env.Desk")).__name__ == "Desk"
        assert type(load_environment("my_env", "Desk")).__name__ == "Desk"
    finally:
        sys.path.remove(str(tmp_path))
    with pytest.raises(ValueError, match="defines no 'Nope'"):
        load_environment(str(f), "Nope")
    with pytest.raises(ValueError, match="cannot import"):
        load_environment("no_such_module_xyz:Desk")
    (tmp_path / "bad.py").write_text("class B:\n    pass\n")
    with pytest.raises(TypeError, match="no reset"):
        load_environment(str(tmp_path / "bad.py"), "B")


ENV_SRC = """
class Echo:
    # ends after two assistant turns; rewards answers that contain a digit
    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, history):
        turns = sum(m["role"] == "assistant" for m in history)
        ok = float(any(ch.isdigit() for ch in history[-1]["content"]))
        return (None if turns >= 2 else "1 more"), {"correct": ok, "length": len(history[-1]["content"]) / 10}
"""


def echo_setup(tmp_path) -> list:
    """A micro run's overrides with the Echo environment (up to 3 turns of at most 4 tokens) and a
    random model whose turns end early (more stop tokens)."""
    root = str(tmp_path)
    (tmp_path / "env.py").write_text(ENV_SRC)
    overrides = micro_setup(root) + [
        f"environment.path={root}/env.py", "environment.name=Echo", "environment.max_turns=3",
        "environment.max_turn_tokens=4", "data.max_response_length=14", "custom_reward_function.path=null",
        "reward_model.dialogue.weights={correct: 1.0, length: 0.5}", "reward_model.overlong_buffer.enable=false",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=64"]
    stops = [1] + [load_tokenizer(f"{root}/model").tok.token_to_id(c) for c in "0123+"]
    with open(f"{root}/model/generation_config.json", "w") as f:
        json.dump({"eos_token_id": stops}, f)
    return overrides


def test_micro_run_with_environment(tmp_path):
    overrides = echo_setup(tmp_path) + [
        "algorithm.filter_groups.metric=seq_reward", "algorithm.filter_groups.reward_threshold=0.5",
        "algorithm.filter_groups.prefer=longest", "trainer.total_training_steps=2",
        "algorithm.filter_groups.max_num_gen_batches=0"]
    t = DAPOTrainer(load_config(overrides=overrides))
    m = t.fit()
    assert m["dialog/turns_per_dialog"] > 1 and m["dialog/env_tokens"] > 0
    assert 0 < m["dialog/assistant_token_fraction"] < 1
    assert m["train/num_tokens"] < m["response_length/mean"] * 2 * 4  # env tokens are not trained on
