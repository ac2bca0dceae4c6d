"""Mistakes that used to fail late or deep inside (issue 40, items 14 and 15) are errors at start-up,
before any model is built or file written, naming the dotted key or the file (and line)."""
import re
import sys
import types

import pytest
import torch

from dapo_trainer import demo, train
from dapo_trainer import trainer as trainer_mod
from dapo_trainer.config import load_config
from dapo_trainer.data import load_rows
from dapo_trainer.demo import __main__ as demo_main
from dapo_trainer import rollout_dump
from dapo_trainer.trainer import DAPOTrainer
from npu_ops import _lazy as npu_lazy
from tests.trainer.tiny import micro_setup


# --------------------------------------------------------------------------- item 14: float16 weights
def test_float16_parameters_refused_at_load_naming_the_key_and_the_way_out():
    """actor_rollout_ref.model.dtype=float16 is refused at load (AdamW in float16 turns the weights
    inf / NaN at the first step); bfloat16 and float32 load."""
    with pytest.raises(ValueError, match=r"config key 'actor_rollout_ref.model.dtype': float16 .*inf / NaN.*bfloat16"):
        load_config(overrides=["actor_rollout_ref.model.dtype=float16"])
    for dtype in ("bfloat16", "float32"):
        assert load_config(overrides=[f"actor_rollout_ref.model.dtype={dtype}"]).actor_rollout_ref.model.dtype == dtype


# --------------------------------------------------------------------------- item 15: YAML syntax
@pytest.mark.parametrize("text,line,match", [
    ("data:\n\ttrain_batch_size: 8\n", 2, r"cannot start any token; YAML indents with spaces"),
    ("data:\n  train_batch_size: 8\n   max_prompt_length: 4\n", 3, "mapping values are not allowed here"),
    ("trainer:\n  seed: !!python/object/apply:os.system ['echo hi']\n", 2,
     "could not determine a constructor for the tag 'tag:yaml.org,2002:python/object/apply:os.system'"),
    ("data:\n  train_files: [a.jsonl\n", 3, "expected ',' or ']'"),
])
def test_yaml_syntax_errors_name_the_file_and_line(tmp_path, text, line, match):
    """A config file with a tab, bad indentation, a python/* tag or an unclosed list is a ValueError
    (what the CLI reports in one line) naming the file and the line, not a yaml traceback."""
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:{line}: not valid YAML \(.*{re.escape(match)}"):
        load_config(str(path))
    with pytest.raises(SystemExit, match=rf"^config error: {re.escape(str(path))}:{line}: not valid YAML"):
        train.main(["--config", str(path)])


# --------------------------------------------------------------------------- item 15: trainer.device
@pytest.fixture
def no_model(monkeypatch):
    """Building or loading a model fails the test: the error must come before."""
    def built(*a, **k):
        raise AssertionError("a model was built before the error")

    monkeypatch.setattr(trainer_mod, "build_model", built)
    monkeypatch.setattr(trainer_mod, "load_hf_model", built)


def test_cuda_without_cuda_names_trainer_device_before_any_model(tmp_path, monkeypatch, no_model):
    """trainer.device=cuda where CUDA is not available: a ValueError naming trainer.device from the
    trainer's constructor, before any model is built; the CLI prints it as one config error line."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    overrides = micro_setup(str(tmp_path)) + ["trainer.device=cuda"]
    with pytest.raises(ValueError, match=r"^trainer.device='cuda': CUDA is not available"):
        DAPOTrainer(load_config(overrides=overrides))
    with pytest.raises(SystemExit, match=r"^config error: trainer.device='cuda': CUDA is not available"):
        train.main(overrides)
    assert not (tmp_path / "run").exists()


def test_npu_without_torch_npu_names_trainer_device_before_any_model(tmp_path, monkeypatch, no_model):
    """trainer.device=npu without torch_npu, or with torch_npu but no NPU: a ValueError naming
    trainer.device, before any model is built."""
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu -> ModuleNotFoundError
    monkeypatch.setattr(npu_lazy, "_error", None)
    overrides = micro_setup(str(tmp_path)) + ["trainer.device=npu"]
    with pytest.raises(ValueError, match=r"^trainer.device='npu' cannot be used here: .*torch_npu"):
        DAPOTrainer(load_config(overrides=overrides))
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))  # installed, no NPU visible
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: False), raising=False)
    with pytest.raises(ValueError, match=r"^trainer.device='npu': torch_npu sees no Ascend NPU"):
        DAPOTrainer(load_config(overrides=overrides))


# --------------------------------------------------------------------------- item 15: parquet without pyarrow
def test_parquet_without_pyarrow_names_the_file_and_the_package(tmp_path, monkeypatch):
    """A .parquet data file where pyarrow is not installed: a ModuleNotFoundError naming the file,
    pyarrow and the install command (was: import of pyarrow.parquet halted)."""
    for name in [m for m in sys.modules if m == "pyarrow" or m.startswith("pyarrow.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    path = tmp_path / "train.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(ModuleNotFoundError, match=rf"{re.escape(str(path))}.*needs pyarrow: pip install pyarrow") as e:
        load_rows(str(path))
    assert e.value.name == "pyarrow"


# --------------------------------------------------------------------------- item 14: rollout_data_dir
@pytest.mark.parametrize("blocker", ["file", "dangling_link"])
def test_unwritable_rollout_data_dir_fails_at_start_up(tmp_path, no_model, blocker):
    """trainer.rollout_data_dir under a file or a dangling link: a ValueError naming the key from the
    trainer's constructor, before any model is built (was: a raw OSError when step 1 dumped)."""
    where = tmp_path / "blocker"
    if blocker == "file":
        where.write_text("not a directory")
    else:
        where.symlink_to(tmp_path / "nowhere")
    overrides = micro_setup(str(tmp_path)) + [f"trainer.rollout_data_dir={where}/rollouts"]
    with pytest.raises(ValueError, match=rf"^trainer.rollout_data_dir: '{re.escape(str(where))}' is not a directory"):
        DAPOTrainer(load_config(overrides=overrides))


def test_check_rollout_dir_refuses_a_read_only_directory(tmp_path, monkeypatch):
    """The nearest existing directory must be writable (os.access: root passes any mode bits, so the
    answer is stubbed); a directory still to be created under a writable one passes."""
    rollout_dump.check_rollout_dir(str(tmp_path / "a" / "b"))
    monkeypatch.setattr(rollout_dump.os, "access", lambda path, mode: path != str(tmp_path))
    with pytest.raises(ValueError, match=rf"trainer.rollout_data_dir: the directory '{tmp_path}' is not writable"):
        rollout_dump.check_rollout_dir(str(tmp_path / "a" / "b"))


# --------------------------------------------------------------------------- item 14: demo overrides
def test_demo_checks_its_overrides_before_the_warm_start(tmp_path, monkeypatch):
    """python -m dapo_trainer.demo with a bad override: the error naming the key comes before the
    warm start is built and before the seed's old run directory is removed."""
    def warm_start(*a, **k):
        raise AssertionError("the warm start was built before the config was checked")

    monkeypatch.setattr(demo, "build_demo", warm_start)
    old_run = tmp_path / "runs" / "seed0"
    old_run.mkdir(parents=True)
    (old_run / "metrics.jsonl").write_text("{}\n")
    args = ["--cache-dir", str(tmp_path / "cache"), "--run-dir", str(tmp_path / "runs")]
    with pytest.raises(TypeError, match=r"config key 'trainer.total_training_steps' must be int, got str 'abc'"):
        demo_main.main(args + ["trainer.total_training_steps=abc"])
    with pytest.raises(ValueError, match=r"config key 'actor_rollout_ref.rollout.n'"):
        demo.run_demo(cache_dir=str(tmp_path / "cache"), run_dir=str(old_run),
                      overrides=["actor_rollout_ref.rollout.n=0"])
    assert (old_run / "metrics.jsonl").exists() and not (tmp_path / "cache").exists()


# --------------------------------------------------------------------------- item 15: carried groups
def test_resume_with_another_max_response_length_and_carried_groups_names_both(tmp_path):
    """A checkpoint carrying kept groups over, resumed with another data.max_response_length (or
    max_prompt_length): a ValueError from the constructor naming the key and both values (was: a
    size mismatch inside the accumulator's take() at the next step); the same lengths resume."""
    overrides = micro_setup(str(tmp_path)) + [
        "trainer.total_training_steps=1", "trainer.val_before_train=false", "data.val_files=[]",
        "algorithm.filter_groups.enable=false", "data.gen_batch_size=6"]  # 6 groups kept, 2 trained, 4 carried
    DAPOTrainer(load_config(overrides=overrides)).fit()
    more = overrides + ["trainer.total_training_steps=2"]
    assert DAPOTrainer(load_config(overrides=more)).generation.accumulator.num_buffered_groups == 4
    for key, old, new in (("data.max_response_length", 5, 6), ("data.max_prompt_length", 6, 7)):
        with pytest.raises(ValueError, match=rf"^{key}={new}, but the checkpoint being resumed carries 4 kept "
                                             rf"groups .* sampled with {key}={old}: resume with {key}={old}"):
            DAPOTrainer(load_config(overrides=more + [f"{key}={new}"]))
