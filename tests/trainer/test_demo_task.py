"""The demo task (generation, held-out split), its assets (tokenizer, model dir, cached
warm start) and a 2-step smoke of the main job through the real trainer."""
import json
import os
import random

import pytest

from dapo_trainer.demo import DemoConfig, TaskConfig, build_demo, read_metrics, run_demo
from dapo_trainer.demo.arithmetic import make_split, sample_problem
from dapo_trainer.hf_io import read_hf_config
from dapo_trainer.rewards import default_compute_score

# A model and warm start small enough for a unit test (seconds, one core).
TINY = dict(hidden_size=64, intermediate_size=128, num_layers=1, num_heads=1, head_dim=64,
            num_train=300, num_val=12, warm_start_steps=3, warm_start_batch_size=8)


@pytest.mark.parametrize("ops", [("sort",), ("+",), ("-",), ("*",), ("sort", "+", "-", "*")], ids="".join)
@pytest.mark.parametrize("little_endian", [False, True], ids=["big-endian", "little-endian"])
def test_problems_are_right(ops, little_endian):
    task = TaskConfig(ops=ops, little_endian=little_endian, max_digits=random.randint(1, 4))
    rng = random.Random(random.randrange(2**31))
    for _ in range(200):
        p = sample_problem(rng, task)
        body = p.prompt[:-1]
        assert p.prompt.endswith("=")
        if body.startswith("sort:"):
            assert p.answer == "".join(sorted(body[5:]))
            continue
        op = next(o for o in "+-*" if o in body)
        a, b = body.split(op)
        read = (lambda s: int(s[::-1])) if little_endian else int
        expect = {"+": read(a) + read(b), "-": read(a) - read(b), "*": read(a) * read(b)}[op]
        assert read(p.answer) == expect >= 0
        assert default_compute_score("arithmetic", p.answer, p.answer)["acc"] == 1.0


def test_split_is_deterministic_and_held_out():
    task, seed = TaskConfig(), random.randrange(1000)
    train, val = make_split(task, seed, 2000, 100)
    assert (train, val) == make_split(task, seed, 2000, 100)
    assert val == make_split(task, seed, 50, 100)[1]  # growing the train set keeps val
    assert len({p.prompt for p in val}) == 100
    assert not {p.prompt for p in train} & {p.prompt for p in val}


def test_bad_settings():
    with pytest.raises(ValueError, match="TaskConfig.ops"):
        TaskConfig(ops=("/",))
    with pytest.raises(ValueError, match="TaskConfig.max_digits"):
        TaskConfig(max_digits=0)
    with pytest.raises(ValueError, match="num_val.*exceeds"):
        make_split(TaskConfig(ops=("*",), mul_digits=1), 0, 10, 500)  # only 100 distinct problems
    with pytest.raises(TypeError, match="cfg must be a DemoConfig"):
        build_demo({"seed": 0})


def test_assets_are_an_hf_model_dir_and_cached(tmp_path):
    from tokenizers import Tokenizer

    from dapo_trainer.hf_io import load_hf_model

    cfg = DemoConfig(seed=random.randrange(100), **TINY)
    a = build_demo(cfg, cache_dir=str(tmp_path), progress=False)
    assert a.built
    tok = Tokenizer.from_file(os.path.join(a.model_dir, "tokenizer.json"))
    assert tok.decode(tok.encode("sort:3120=").ids) == "sort:3120="
    tc = json.load(open(os.path.join(a.model_dir, "tokenizer_config.json")))
    assert tok.token_to_id(tc["eos_token"]) == 1 and tok.token_to_id(tc["pad_token"]) == 0
    model = load_hf_model(a.model_dir)
    assert model.config.vocab_size == tok.get_vocab_size() and model.config.head_dim == 64
    info = a.warm_start_info()
    assert len(info["losses"]) == cfg.warm_start_steps and info["key"] == cfg.key()
    mtime = os.path.getmtime(os.path.join(a.model_dir, "model.safetensors"))
    again = build_demo(cfg, cache_dir=str(tmp_path), progress=False)
    assert not again.built and again.root == a.root
    assert os.path.getmtime(os.path.join(a.model_dir, "model.safetensors")) == mtime
    # A changed setting is a different cache entry; no half-built temp dirs are left.
    assert DemoConfig(**{**TINY, "seed": cfg.seed, "warm_start_steps": 4}).key() != cfg.key()
    assert sorted(os.listdir(tmp_path)) == [cfg.key()]


def test_main_job_smoke(tmp_path):
    """Two steps on the tiny warm start through the real trainer, then the report (filtering off:
    a 3-step warm start gets almost no mixed groups, and unlimited re-sampling would never end)."""
    from dapo_trainer.tools.report import write_report

    run_dir = str(tmp_path / "run")
    res = run_demo(seed=1, cache_dir=str(tmp_path / "cache"), run_dir=run_dir, progress=False,
                   demo_config=DemoConfig(seed=1, **TINY),
                   overrides=["trainer.total_training_steps=2", "trainer.save_freq=0", "data.gen_batch_size=4",
                              "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                              "actor_rollout_ref.rollout.n=4", "algorithm.filter_groups.enable=false",  # an untrained model: no mixed groups
                              "trainer.progress_bar=false", "trainer.logger=[console]"])
    assert 0.0 <= res["before"] <= 1.0 and 0.0 <= res["after"] <= 1.0
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2] and "val/acc" in rows[0] and "val/acc" in rows[-1]
    assert os.path.isfile(write_report(run_dir))


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_family_switch_smoke(tmp_path, family):
    """DemoConfig.family (--family): the warm start and two DAPO steps on a tiny Qwen3 / Qwen3-MoE; its
    checkpoint says the family, and the MoE run logs its routers' load."""
    run_dir = str(tmp_path / "run")
    res = run_demo(seed=1, cache_dir=str(tmp_path / "cache"), run_dir=run_dir, progress=False,
                   demo_config=DemoConfig(seed=1, family=family, **TINY),
                   overrides=["trainer.total_training_steps=2", "trainer.save_freq=0", "data.gen_batch_size=4",
                              "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                              "actor_rollout_ref.rollout.n=4", "algorithm.filter_groups.enable=false",
                              "trainer.progress_bar=false", "trainer.logger=[console]"])
    assert read_hf_config(res["assets"].model_dir).model_type == family
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert ("actor/moe_load_max" in rows[-1]) == (family == "qwen3_moe")
    with pytest.raises(ValueError, match="DemoConfig.family must be one of"):
        DemoConfig(family="mixtral")


def test_warm_start_targets_mix_conventions():
    from dapo_trainer.demo.assets import warm_start_targets

    task = TaskConfig(ops=("sort", "+"))
    train, _ = make_split(task, random.randrange(1000), 4000, 10)
    frac = random.uniform(0.2, 0.8)
    cfg = DemoConfig(seed=random.randrange(100), task=task, warm_start_descending=frac)
    targets = warm_start_targets(train, cfg)
    assert targets == warm_start_targets(train, cfg)  # seeded
    sorts = [(p, t) for p, t in zip(train, targets) if p.prompt.startswith("sort:")]
    assert all(t == p.answer for p, t in zip(train, targets) if not p.prompt.startswith("sort:"))
    assert all(t in (p.answer, p.answer[::-1]) for p, t in sorts)
    desc = [t != p.answer for p, t in sorts if p.answer != p.answer[::-1]]
    assert abs(sum(desc) / len(desc) - frac) < 0.05, (sum(desc) / len(desc), frac)
    assert warm_start_targets(train, DemoConfig(task=task, warm_start_descending=0.0)) == [p.answer for p in train]
    with pytest.raises(ValueError, match="warm_start_descending"):
        DemoConfig(warm_start_descending=1.5)


def test_dialog_demo_env_and_warm_start_encoding_match_the_chat_template(tmp_path):
    """The desk's environment semantics, and the warm start's hand-laid tokens are exactly what the
    trainer's chat-template rendering produces (prompt, assistant turns, environment turns)."""
    from dapo_trainer.data import load_tokenizer
    from dapo_trainer.demo.dialog import ASK, OrderDeskEnv, _tokenizer, demonstration, encode_dialogue, sample_row

    rng = random.Random(random.randrange(2**31))
    _tokenizer(str(tmp_path))
    tok = load_tokenizer(str(tmp_path))
    env = OrderDeskEnv()
    for _ in range(20):
        row = sample_row(rng, 4)
        row = {**row, "ground_truth": row["answer"]}
        opening = env.reset(row)
        msg, c = env.step(opening + [{"role": "assistant", "content": ASK}], row)
        assert msg == {"role": "user", "content": row["extra_info"]["order_id"]} and c["correct"] == 0.0
        hist = opening + [{"role": "assistant", "content": ASK}, msg]
        assert env.step(hist + [{"role": "assistant", "content": row["answer"]}], row) == \
            (None, {"correct": 1.0, "acc": 1.0})
        lines = opening[0]["content"].split()
        # The table: "#1late #2held ...", order numbers in table order, fixed-width lines.
        assert [ln[:2] for ln in lines] == [f"#{i}" for i in range(1, 5)] and {len(ln) for ln in lines} == {6}
        assert row["answer"] == lines[int(row["extra_info"]["order_id"]) - 1]
        wrong = next(ln for ln in lines if ln != row["answer"])
        # Any turn but the question is the answer: a wrong line at once, or after asking, ends it unscored.
        assert env.step(opening + [{"role": "assistant", "content": wrong}], row) == (None, {"correct": 0.0, "acc": 0.0})
        assert env.step(hist + [{"role": "assistant", "content": wrong}], row)[1]["correct"] == 0.0
        assert env.step(hist + [{"role": "assistant", "content": ASK}], row)[0] is None  # no third turn
        for guess in (False, True):
            turns = demonstration(row, guess, rng)
            p, cont, mask = encode_dialogue(tok.tok, tok.eos_token_id, row, turns)
            assert p == tok.encode(tok.render_chat(opening, add_generation_prompt=True), add_special_tokens=False)
            full = tok.encode(tok.render_chat(opening + turns, add_generation_prompt=False), add_special_tokens=False)
            # The template ends an environment turn with the next generation prompt, as the rollout does.
            assert p + cont == full[:len(p + cont)] and len(full) >= len(p + cont)
            learned = tok.decode([t for t, m in zip(cont, mask) if m])
            assert learned == "".join(m["content"] for m in turns if m["role"] == "assistant")


def test_dialog_main_job_smoke(tmp_path):
    """The dialogue demo end to end on a tiny warm start: two steps through the trainer with the
    desk environment, held-out success logged before and after, per-turn metrics, the report."""
    from dapo_trainer.demo.dialog import DialogDemoConfig
    from dapo_trainer.demo import DIALOG_CONFIG
    from dapo_trainer.tools.report import write_report

    run_dir = str(tmp_path / "run")
    res = run_demo(seed=1, config=DIALOG_CONFIG, cache_dir=str(tmp_path / "cache"), run_dir=run_dir, progress=False,
                   task="dialog", demo_config=DialogDemoConfig(seed=1, num_train=64, num_val=8, warm_start_steps=3,
                                                               warm_start_batch_size=8),
                   overrides=["trainer.total_training_steps=2", "trainer.save_freq=0", "data.gen_batch_size=4",
                              "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                              "actor_rollout_ref.rollout.n=4", "algorithm.filter_groups.enable=false",
                              "trainer.progress_bar=false", "trainer.logger=[console]"])
    assert 0.0 <= res["before"] <= 1.0 and 0.0 <= res["after"] <= 1.0
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2] and "val/acc" in rows[0] and "val/acc" in rows[-1]
    turns = [r["dialog/turns_per_dialog"] for r in rows if "dialog/turns_per_dialog" in r]  # steps that generated
    assert turns and all(1 <= t <= 2 for t in turns)
    assert "turns per dialogue" in open(write_report(run_dir)).read()


@pytest.mark.slow
def test_dialog_warm_start_looks_up_but_guesses(tmp_path):
    """What makes the dialogue demo learnable: the warm-started model answers right once the order
    number is in context (so asking pays), yet greedily guesses at once (so held-out success starts
    low), and samples the question often enough for DAPO to find it. A warm start that answers at
    chance after asking gives RL nothing to learn."""
    import torch

    from dapo_trainer.data import load_rows, load_tokenizer
    from dapo_trainer.demo.dialog import ASK, DialogDemoConfig, OrderDeskEnv, build_dialog_demo
    from dapo_trainer.hf_io import load_hf_model
    from dapo_trainer.rollout import RolloutConfig, make_rollout
    from dapo_trainer.rollout.multiturn import multi_turn_rollout

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the demo runs it: the tiny model's matmuls lose to thread sync
    try:
        assets = build_dialog_demo(DialogDemoConfig(seed=0), cache_dir=str(tmp_path), progress=False)
    finally:
        torch.set_num_threads(threads)
    tok = load_tokenizer(assets.model_dir)
    engine = make_rollout(RolloutConfig(), load_hf_model(assets.model_dir, torch.float32, torch.device("cpu")))
    val = load_rows([assets.val_file])
    # The number in context (the asking dialogue up to the answer): greedy answers.
    ctx = [tok.encode(tok.render_chat(r["prompt"] + [{"role": "assistant", "content": ASK},
                                                     {"role": "user", "content": r["extra_info"]["order_id"]}]),
                      add_special_tokens=False) for r in val]
    out = engine.generate(ctx, 1, 8, temperature=0.0, stop_token_ids=tok.eos_token_ids)
    looked_up = sum(tok.decode(out.response(k)[:-1]) == r["ground_truth"] for k, r in enumerate(val)) / len(val)
    assert looked_up >= 0.9, looked_up

    def first_turns(temperature, n):
        o = multi_turn_rollout(engine, tok, OrderDeskEnv(), val, n, max_prompt_length=60, max_response_length=24,
                               max_turns=2, max_turn_tokens=8, temperature=temperature, seed=1)
        return [c.messages[2]["content"] == ASK for c in o.conversations], [c.components["acc"] for c in o.conversations]

    asks, acc = first_turns(0.0, 1)
    assert not any(asks) and sum(acc) / len(acc) < 0.4, (sum(asks), sum(acc))  # greedy guesses
    asks, _ = first_turns(1.0, 8)
    assert 0.2 <= sum(asks) / len(asks) <= 0.6, sum(asks) / len(asks)  # sampled: asks often enough
