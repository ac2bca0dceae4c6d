"""dapo_trainer.data: jsonl / parquet rows, the model directory's tokenizer, the resumable cursor."""
import json
import time

import pytest

from dapo_trainer.data import BatchCursor, apply_template, encode_prompt, load_rows, load_tokenizer
from tests.trainer.tiny import write_char_tokenizer


def _jsonl(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(path)


def test_jsonl_answer_and_gsm8k_final_answer(tmp_path):
    f = _jsonl(tmp_path / "a.jsonl", [{"prompt": "1+1=", "answer": 2, "data_source": "arithmetic"},
                                      {"prompt": "q", "answer": "3 apples + 4 = 7 apples\n#### 7"}])
    rows = load_rows(f)
    assert rows == [{"prompt": "1+1=", "ground_truth": "2", "data_source": "arithmetic", "extra_info": {}},
                    {"prompt": "q", "ground_truth": "7", "data_source": "unknown", "extra_info": {}}]


def test_eos_token_missing_from_vocabulary_is_named(tmp_path):
    """tokenizer_config.json naming an eos_token the vocabulary lacks (and no eos id elsewhere) is a
    ValueError naming the file and the token, not "no eos token found"."""
    write_char_tokenizer(str(tmp_path))
    for name in ("generation_config.json", "config.json"):
        if (tmp_path / name).exists():
            cfg = json.loads((tmp_path / name).read_text())
            cfg.pop("eos_token_id", None)
            (tmp_path / name).write_text(json.dumps(cfg))
    tc = json.loads((tmp_path / "tokenizer_config.json").read_text())
    tc["eos_token"] = "<|no_such_token|>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tc))
    with pytest.raises(ValueError, match=r"tokenizer_config.json: eos_token '<\|no_such_token\|>' is not in the voc"):
        load_tokenizer(str(tmp_path))


def test_float_answer_column_reads_as_its_integer(tmp_path):
    """A float answer column (3.0, as pandas writes an int column with a gap) gives ground truth "3";
    a fractional one keeps its value."""
    f = _jsonl(tmp_path / "f.jsonl", [{"prompt": "1+2=", "answer": 3.0}, {"prompt": "q", "answer": 2.5}])
    assert [r["ground_truth"] for r in load_rows(f)] == ["3", "2.5"]


def test_parquet_verl_layout_with_chat_prompt(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="pyarrow is needed to read parquet")
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist([
        {"data_source": "math_dapo", "prompt": [{"role": "user", "content": "Solve x"}],
         "reward_model": {"ground_truth": "34", "style": "rule"}},
    ])
    pq.write_table(table, tmp_path / "d.parquet")
    (row,) = load_rows([str(tmp_path / "d.parquet")])
    assert row == {"prompt": [{"role": "user", "content": "Solve x"}], "ground_truth": "34", "data_source": "math_dapo",
                   "extra_info": {}}


@pytest.mark.parametrize("recs,match", [
    ([{"question": "x", "answer": "1"}], "no 'prompt' column"),
    ([{"prompt": "x"}], "no answer"),
    ([{"prompt": 3, "answer": "1"}], "prompt must be a str"),
])
def test_bad_rows_name_the_problem(tmp_path, recs, match):
    with pytest.raises(ValueError, match=match):
        load_rows(_jsonl(tmp_path / "b.jsonl", recs))


def test_missing_or_unknown_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_rows(str(tmp_path / "nope.jsonl"))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="expected a .jsonl"):
        load_rows(str(tmp_path / "x.csv"))


def test_template():
    assert apply_template("2+2=", "Q: {prompt}\nA:") == "Q: 2+2=\nA:"
    with pytest.raises(ValueError, match="prompt_template"):
        apply_template("x", "no slot")


def test_tokenizer_round_trip_and_special_ids(tmp_path):
    write_char_tokenizer(str(tmp_path))
    tok = load_tokenizer(str(tmp_path))
    ids = tok.encode("12+34=46\n")
    assert tok.decode(ids + [tok.eos_token_id, tok.pad_token_id]) == "12+34=46\n"
    assert (tok.pad_token_id, tok.eos_token_id) == (0, 1)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 5]}))
    assert load_tokenizer(str(tmp_path)).eos_token_ids == (1, 5)
    assert encode_prompt(tok, "123456", 4, "left") == tok.encode("3456")
    with pytest.raises(ValueError, match="max_prompt_length"):
        encode_prompt(tok, "123456", 4, "error")


def test_tokenizer_missing(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path))


def test_cursor_deterministic_epochs_and_resume():
    c = BatchCursor(10, 4, seed=3)
    first = [c.next_batch() for _ in range(5)]
    flat = sum(first, [])
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))
    c2 = BatchCursor(10, 4, seed=3)
    c2.next_batch(), c2.next_batch()
    c3 = BatchCursor(10, 4, seed=3)
    c3.load_state_dict(c2.state_dict())
    assert [c3.next_batch() for _ in range(3)] == first[2:]
    with pytest.raises(ValueError, match="same data"):
        BatchCursor(11, 4).load_state_dict(c2.state_dict())


# A few-MB prompt line: tokenised whole, the char-level tokenizer spends seconds of CPU on it.
HUGE = "1+2=" * 500_000


@pytest.mark.parametrize("truncation", ["left", "right", "error"])
def test_huge_prompt_costs_what_the_limit_does(tmp_path, truncation):
    """A 2 MB prompt held to 8 tokens: truncated (left / right: the same ids as cutting the whole
    text's) or refused (error, naming the limit) within 0.5 s of CPU time, not by tokenising it all."""
    write_char_tokenizer(str(tmp_path))
    tok = load_tokenizer(str(tmp_path))
    t0 = time.process_time()
    if truncation == "error":
        with pytest.raises(ValueError, match="a prompt of 2000000 characters has over 8 tokens"):
            encode_prompt(tok, HUGE, 8, truncation)
    else:
        ids = encode_prompt(tok, HUGE, 8, truncation)
    assert time.process_time() - t0 < 0.5
    if truncation != "error":
        whole = tok.encode(HUGE)
        assert ids == (whole[-8:] if truncation == "left" else whole[:8])


def test_over_long_prompt_is_refused_on_load_naming_file_and_row(tmp_path, monkeypatch):
    """data.truncation=error with a 2 MB prompt on row 3 of the train file: the trainer refuses at start-up,
    before building a model, naming the file, line and row, within 2 s of CPU time."""
    import dapo_trainer.trainer as trainer_mod
    from dapo_trainer.config import load_config
    from dapo_trainer.trainer import DAPOTrainer
    from tests.trainer.tiny import micro_setup

    overrides = micro_setup(str(tmp_path)) + ["data.truncation=error"]
    lines = (tmp_path / "train.jsonl").read_text().splitlines(keepends=True)
    lines[3] = json.dumps({"prompt": HUGE, "answer": "3"}) + "\n"
    (tmp_path / "train.jsonl").write_text("".join(lines))

    def no_model(*a, **k):
        raise AssertionError("a model was built")

    monkeypatch.setattr(trainer_mod, "build_model", no_model)
    t0 = time.process_time()
    with pytest.raises(ValueError, match=r"train.jsonl:4 \(row 3\): a prompt of 2000000 characters has over 6 "
                                         r"tokens.*data.max_prompt_length=6"):
        DAPOTrainer(load_config(overrides=overrides))
    assert time.process_time() - t0 < 2.0
