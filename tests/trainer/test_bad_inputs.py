"""Bad inputs to the trainer's readers, reward checks, checkpoints and diagnostics CLIs fail
at once with an error naming the file (and line), the row, the key or the reward function; the CLIs
print one line (no traceback) unless ``--debug``."""
import json
import os
import sys

import numpy as np
import pytest
import torch

from dapo_trainer import checkpoint as ckpt
from dapo_trainer import readers
from dapo_trainer.chat import check_messages, render_chat
from dapo_trainer.data import load_rows
from dapo_trainer.hf_io import load_hf_model, read_hf_config, save_hf_model
from dapo_trainer.model import ModelConfig, Transformer
from dapo_trainer.rewards import check_reward
from dapo_trainer.run_dir import check_checkpoint_dir
from dapo_trainer.tools import batch_quality, profiler, report, tune

TINY = ModelConfig(vocab_size=8, hidden_size=4, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                   head_dim=4, max_position_embeddings=8)
LATIN1 = "caf\xe9".encode("latin-1")  # not UTF-8


def _jsonl(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(path)


def _row(prompt):
    return {"prompt": prompt, "answer": "1"}


# --------------------------------------------------------------------------- item 3: chat content
@pytest.mark.parametrize("messages,match", [
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}],
     r"row 0\): prompt\[1\]\['content'\] must be a str .* got NoneType"),
    ([{"role": 7, "content": "hi"}], r"row 0\): prompt\[0\]\['role'\] must be a str, got int"),
    ([{"role": "user", "content": [{"type": "image", "image": "x.png"}]}],
     r"row 0\): prompt\[0\]\['content'\]\[0\] is a 'image' part: only text parts"),
    ([{"role": "user", "content": [{"type": "text"}]}], r"row 0\): prompt\[0\]\['content'\]\[0\]"),
    ([{"role": "user", "content": ["hi"]}], r"row 0\): prompt\[0\]\['content'\]\[0\]"),
    ([], r"row 0\): prompt is an empty message list"),
    (["hi"], r"row 0\): prompt\[0\] must be a \{'role', 'content'\} message, got str"),
])
def test_chat_content_that_is_not_a_string_names_row_and_message(tmp_path, messages, match):
    """A message whose content is not text, whose role is not a str, or an empty message list is a
    ValueError naming the file, the row and the message index (never str()-ed into the prompt)."""
    f = _jsonl(tmp_path / "d.jsonl", [_row(messages)])
    with pytest.raises(ValueError, match=match) as e:
        load_rows(f)
    assert "d.jsonl" in str(e.value)


def test_text_parts_are_joined_and_role_defaults_to_user(tmp_path):
    """A list of ``{"type": "text", "text": ...}`` parts (verl / transformers' form) is its texts
    concatenated; a message without a role stays a user message (as before)."""
    parts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "1 + 0?"}]
    (row,) = load_rows(_jsonl(tmp_path / "d.jsonl", [_row([{"role": "user", "content": parts}, {"content": "ok"}])]))
    assert row["prompt"] == [{"role": "user", "content": "What is 1 + 0?"}, {"role": "user", "content": "ok"}]
    assert check_messages([{"role": "user", "content": parts}])[0]["content"] == "What is 1 + 0?"
    with pytest.raises(ValueError, match=r"messages\[0\]\['content'\] must be a str"):
        render_chat("{{ messages[0]['content'] }}", [{"role": "user", "content": 3}])


# --------------------------------------------------------------------------- items 7 + 11: rewards
@pytest.mark.parametrize("value,exc,match", [
    (None, TypeError, "got NoneType"),
    ("good", TypeError, "got str 'good'"),
    ("1.0", TypeError, "got str '1.0'"),
    ([1.0], TypeError, "got list"),
    ({"score": "high"}, TypeError, r"\['score'\] .*got str 'high'"),
    ({"acc": 1.0}, ValueError, "no 'score' key"),
    ({"score": 1.0, "acc": float("nan")}, ValueError, r"\['acc'\] .*nan"),
    ({"score": 1.0, "extra": None}, TypeError, r"\['extra'\] .*NoneType"),
    (float("nan"), ValueError, "not finite"),
    (float("inf"), ValueError, "not finite"),
    (1e308, ValueError, "magnitude"),
    (-1e308, ValueError, "magnitude"),
    ({"score": np.float64(-1e300)}, ValueError, "magnitude"),
    (torch.tensor(1.0), TypeError, "Tensor"),
])
def test_check_reward_rejects_non_numbers_naming_function_sample_and_row(value, exc, match):
    """Anything but a real finite number (or a dict with a 'score' key of them) is an error naming
    the reward function, the sample index and the row."""
    with pytest.raises(exc, match=match) as e:
        check_reward(value, fn_name="my_score", sample_index=5, row_index=2)
    msg = str(e.value)
    assert "my_score" in msg and "sample 5" in msg and "row 2" in msg


def test_check_reward_accepts_numbers_and_verl_dicts():
    """bool / int / float / numpy scalars are floats; a dict keeps its numeric values as floats and
    its str values (verl's math_dapo returns ``pred``) as they are."""
    assert check_reward(True, fn_name="f", sample_index=0, row_index=0) == (1.0, {})
    for v in (1, 1.0, np.float32(1.0), np.int64(1), np.bool_(True)):
        score, comps = check_reward(v, fn_name="f", sample_index=0, row_index=0)
        assert score == 1.0 and type(score) is float and comps == {}
    score, comps = check_reward({"score": np.float32(0.5), "acc": True, "pred": "42"}, fn_name="f",
                                sample_index=0, row_index=0)
    assert score == 0.5 and comps == {"score": 0.5, "acc": 1.0, "pred": "42"}
    assert type(comps["acc"]) is float


# --------------------------------------------------------------------------- item 10: checkpoints
def _parts():
    model = Transformer(TINY).init_weights(std=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


def _save(root, dir_step, state_step):
    model, opt, sch = _parts()
    d = ckpt.save_checkpoint(str(root), dir_step, model=model, full_state=model.state_dict(), optimizer=opt,
                             scheduler=sch, trainer_state={"step": state_step})
    return d, opt, sch


def test_state_step_must_match_the_checkpoint_directory(tmp_path):
    """A state file whose step disagrees with its global_step_N directory (or, under another name,
    its manifest) is rejected naming both; a matching one loads."""
    d, opt, sch = _save(tmp_path / "c", 3, 2)
    assert ckpt.incomplete_reason(d) is None
    with pytest.raises(ValueError, match=r"state_rank0.safetensors.* step 2.*global_step_3"):
        ckpt.load_checkpoint(d, optimizer=opt, scheduler=sch)
    moved = str(tmp_path / "my_ckpt")
    os.rename(d, moved)
    with pytest.raises(ValueError, match=r"step 2.*manifest.json.* step 3"):
        ckpt.load_checkpoint(moved, optimizer=opt, scheduler=sch)
    d, opt, sch = _save(tmp_path / "ok", 4, 4)
    assert ckpt.load_checkpoint(d, optimizer=opt, scheduler=sch)["step"] == 4


def test_check_checkpoint_dir(tmp_path):
    """A checkpoint path that is, or lies under, an existing file is a ValueError naming the key
    and the file; a directory to be created is fine."""
    (tmp_path / "f").write_text("x")
    for path in (tmp_path / "f", tmp_path / "f" / "checkpoints"):
        with pytest.raises(ValueError, match=rf"trainer.default_local_dir: .*{tmp_path / 'f'}.* is a file"):
            check_checkpoint_dir(str(path), "trainer.default_local_dir")
    check_checkpoint_dir(str(tmp_path / "new" / "checkpoints"), "trainer.default_local_dir")
    check_checkpoint_dir(str(tmp_path), "trainer.default_local_dir")
    with pytest.raises(TypeError, match="trainer.default_local_dir"):
        check_checkpoint_dir(None, "trainer.default_local_dir")


def test_corrupted_safetensors_names_the_file(tmp_path):
    """A model.safetensors whose header is corrupted (same size) is a ValueError naming the file."""
    save_hf_model(Transformer(TINY).init_weights(std=0.1), str(tmp_path))
    f = tmp_path / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8] = ord("#")  # the JSON header's opening brace
    f.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"model.safetensors.*not a readable safetensors file"):
        load_hf_model(str(tmp_path))


def test_config_json_fields_named_with_the_file(tmp_path):
    """A non-integer size in config.json, or a config.json that is not UTF-8 / JSON, is a ValueError
    naming the file (and line)."""
    save_hf_model(Transformer(TINY).init_weights(std=0.1), str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, hidden_size="64"), indent=1))
    with pytest.raises(ValueError, match=r"config.json: hidden_size must be an int >= 1, got str '64'"):
        read_hf_config(str(tmp_path))
    (tmp_path / "config.json").write_bytes(b'{\n"a": "' + LATIN1 + b'"}')
    with pytest.raises(ValueError, match=r"config.json:2: not UTF-8"):
        read_hf_config(str(tmp_path))
    (tmp_path / "config.json").write_text('{\n"a": 1,\n}')
    with pytest.raises(ValueError, match=r"config.json:3: not valid JSON"):
        read_hf_config(str(tmp_path))


# --------------------------------------------------------------------------- item 12: readers and CLIs
def test_readers_name_file_and_line(tmp_path):
    """The shared readers: a directory, a missing file, a non-UTF-8 byte, a non-JSON line."""
    with pytest.raises(ValueError, match=rf"{tmp_path}.* is a directory"):
        readers.read_text(str(tmp_path))
    with pytest.raises(ValueError, match="does not exist"):
        readers.read_text(str(tmp_path / "nope"))
    p = tmp_path / "x.jsonl"
    p.write_bytes(b'{"a": 1}\n\n{"b": "' + LATIN1 + b'"}\n')
    with pytest.raises(ValueError, match=r"x.jsonl:3: not UTF-8"):
        readers.read_jsonl(str(p))
    p.write_text('{"a": 1}\n\n[1,\n')
    with pytest.raises(ValueError, match=r"x.jsonl:3: not valid JSON"):
        readers.read_jsonl(str(p))
    assert readers.read_jsonl(str(p), skip_partial_last=True) == [(1, {"a": 1})]


@pytest.mark.parametrize("name,content,match", [
    ("data", None, r"data' is a directory"),
    ("d.jsonl", b'{"prompt": "a", "answer": "1"}\n{"prompt": "' + LATIN1 + b'"}\n', r"d.jsonl:2: not UTF-8"),
    ("d.json", b'[\n{"prompt": "' + LATIN1 + b'"}]', r"d.json:2: not UTF-8"),
    ("d.json", b'[\n{"prompt": 1,}]', r"d.json:2: not valid JSON"),
    ("d.parquet", b"PAR1 but not parquet at all PAR1", r"d.parquet: not a readable parquet file"),
])
def test_data_files_errors_name_file_and_line(tmp_path, name, content, match):
    """data.train_files readers: a directory, non-UTF-8 jsonl / json, bad JSON, a broken parquet."""
    path = tmp_path / name
    path.mkdir() if content is None else path.write_bytes(content)
    with pytest.raises(ValueError, match=match):
        load_rows(str(path))


def test_report_bad_metrics_and_rollouts(tmp_path):
    """dapo-report: a non-integer step, a non-UTF-8 line, a non-JSON rollout line and a rollout row
    without response_length are errors naming the file and line."""
    m = tmp_path / "metrics.jsonl"
    m.write_text('{"step": 0}\n{"step": "seven"}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: 'step' must be an int >= 0, got str 'seven'"):
        report.load_metrics(str(tmp_path))
    m.write_bytes(b'{"step": 0}\n{"step": 1, "x": "' + LATIN1 + b'"}\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not UTF-8"):
        report.load_metrics(str(tmp_path))
    ro = tmp_path / "ro"
    ro.mkdir()
    good = {"step": 1, "group": 0, "reward": 1.0, "response_length": 3}
    (ro / "1.jsonl").write_text(json.dumps(good) + "\nnot json\n")
    with pytest.raises(ValueError, match=r"1.jsonl:2: not valid JSON"):
        batch_quality.load_rollouts(str(ro))
    (ro / "1.jsonl").write_text(json.dumps(good) + "\n" + json.dumps({k: v for k, v in good.items()
                                                                      if k != "response_length"}) + "\n")
    with pytest.raises(ValueError, match=r"1.jsonl:2: .*no 'response_length'"):
        batch_quality.load_rollouts(str(ro))
    (ro / "1.jsonl").write_text(json.dumps(dict(good, reward="high")) + "\n")
    with pytest.raises(ValueError, match=r"1.jsonl:1: 'reward' must be a number, got str 'high'"):
        batch_quality.load_rollouts(str(ro))


def _tune_args(model, *extra):
    return ["--task-type", "math", "--hardware", "8xH100", "--model", str(model), *extra]


@pytest.fixture
def small_model(tmp_path):
    d = tmp_path / "model"
    save_hf_model(Transformer(TINY).init_weights(std=0.1), str(d))
    return d


def test_tune_bad_model_profile_and_output(tmp_path, small_model):
    """dapo-tune: a str hidden_size, a keep_rate that is not a number in [0, 1] (or NaN), --output a
    directory: one line naming the file and key, exit status 1."""
    cfg = json.loads((small_model / "config.json").read_text())
    bad = tmp_path / "bad_model"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(dict(cfg, hidden_size="64")))
    with pytest.raises(SystemExit, match=r"dapo-tune: .*bad_model.*config.json: hidden_size must be an int"):
        tune.main(_tune_args(bad))
    for keep in ('"high"', "NaN", "1.5"):
        prof = tmp_path / "profile.json"
        prof.write_text('{"keep_rate": %s, "steps": 3}' % keep)
        with pytest.raises(SystemExit, match=rf"dapo-tune: {prof}: keep_rate must be a number in \[0, 1\]"):
            tune.main(_tune_args(small_model, "--profile", str(prof)))
    with pytest.raises(SystemExit, match=rf"dapo-tune: --output '{tmp_path}' is a directory"):
        tune.main(_tune_args(small_model, "--output", str(tmp_path)))


def test_cli_debug_shows_the_exception(tmp_path, monkeypatch, small_model):
    """Without --debug a CLI prints one line (an unexpected error with its type and a hint); with
    --debug the exception propagates (its traceback)."""
    (tmp_path / "metrics.jsonl").write_text('{"step": "seven"}\n')
    with pytest.raises(SystemExit, match=r"dapo-report: .*metrics.jsonl:1"):
        report.main([str(tmp_path)])
    with pytest.raises(ValueError, match=r"metrics.jsonl:1"):
        report.main([str(tmp_path), "--debug"])
    with pytest.raises(ValueError, match=r"has no config.json"):
        tune.main(_tune_args(tmp_path, "--debug"))  # tmp_path: no config.json

    def boom(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(tune, "tune", boom)
    with pytest.raises(SystemExit, match=r"dapo-tune: RuntimeError: boom \(--debug shows the traceback\)"):
        tune.main(_tune_args(small_model))
    monkeypatch.setattr(profiler, "run_profile", boom)
    with pytest.raises(SystemExit, match=r"dapo-profile: RuntimeError: boom"):
        profiler.main(["--steps", "1", "--no-trace"])
    with pytest.raises(RuntimeError, match="boom"):
        profiler.main(["--steps", "1", "--no-trace", "--debug"])


def test_report_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    """dapo-report without matplotlib: an error with the install command."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "acc/mean": 0.5}\n')
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit, match=r"dapo-report: .*matplotlib.*pip install"):
        report.main([str(tmp_path)])


# --------------------------------------------------------------------------- item 16: report's val label
@pytest.mark.parametrize("logged,config_yaml,want", [
    ({"val/temperature": 0.0}, None, "greedy"),
    ({"val/temperature": 1.0}, None, "sampled at temperature 1"),
    ({}, "actor_rollout_ref:\n  rollout:\n    val_kwargs:\n      temperature: 0.7\n", "sampled at temperature 0.7"),
    ({}, "actor_rollout_ref:\n  rollout:\n    val_kwargs:\n      temperature: 0.0\n", "greedy"),
    ({}, None, None),
])
def test_report_names_the_validation_decoding(tmp_path, logged, config_yaml, want):
    """The report calls validation greedy only when the run logged (or its config.yaml holds)
    val_kwargs.temperature 0; another temperature is named; unknown: neither."""
    rows = [{"step": 0, "val/acc": 0.25, **logged}, {"step": 1, "acc/mean": 0.5, "val/acc": 0.5, **logged}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if config_yaml:
        (tmp_path / "config.yaml").write_text(config_yaml)
    assert report.val_decoding(str(tmp_path), report.load_metrics(str(tmp_path))) == want
    page = open(report.write_report(str(tmp_path))).read()
    assert ("greedy" in page) == (want == "greedy")
    if want:
        assert f"held-out accuracy ({want})" in page
