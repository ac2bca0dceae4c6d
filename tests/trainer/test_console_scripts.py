"""The console scripts of pyproject.toml, run as the installed wrapper runs them (``sys.exit(main())``
with the arguments in ``sys.argv``) in a fresh interpreter: exit status 0 on success and the output
printed once; a bad input exits 1 with one message."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from tests.trainer.test_report import _fake_run
from tests.trainer.tiny import micro_setup

ROOT = Path(__file__).resolve().parents[2]
PRESETS = ROOT / "dapo_trainer" / "configs" / "presets"
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def _run_script(name: str, args, cwd: Path) -> subprocess.CompletedProcess:
    """What pip's generated ``bin/NAME`` does, with the entry point pyproject.toml declares."""
    module, func = SCRIPTS[name].split(":")
    code = f"import sys; from {module} import {func}; sys.argv[0] = {name!r}; sys.exit({func}())"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def test_the_scripts_are_declared():
    assert SCRIPTS == {"dapo-report": "dapo_trainer.tools.report:main",
                       "dapo-profile": "dapo_trainer.tools.profiler:main",
                       "dapo-tune": "dapo_trainer.tools.tune:main"}


def test_dapo_tune_exits_0_and_prints_the_yaml_once(tmp_path):
    preset = PRESETS / "cpu_debug_qwen2.5-0.5b.yaml"
    proc = _run_script("dapo-tune", ["--task-type", "math", "--hardware", "cpu", "--model",
                                     PRESETS / "models" / "qwen2.5-0.5b"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == preset.read_text()  # the preset's first line names this command
    assert (proc.stdout + proc.stderr).count("# dapo-tune --task-type math") == 1


def test_dapo_tune_bad_input_exits_1_with_one_message(tmp_path):
    proc = _run_script("dapo-tune", ["--task-type", "math", "--hardware", "1x24GB", "--model",
                                     PRESETS / "models" / "qwen2.5-7b"], tmp_path)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.count("dapo-tune: 7.62B parameters need") == 1, proc.stderr


def test_dapo_report_exits_0_and_prints_the_page_once(tmp_path):
    _fake_run(tmp_path / "run")
    proc = _run_script("dapo-report", [tmp_path / "run"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    page = str(tmp_path / "run" / "report" / "index.html")
    assert proc.stdout == page + "\n" and (proc.stdout + proc.stderr).count(page) == 1


@pytest.mark.slow
def test_dapo_profile_exits_0_and_prints_the_summary_once(tmp_path):
    overrides = micro_setup(str(tmp_path))
    out = tmp_path / "prof"
    proc = _run_script("dapo-profile", [*overrides, "--steps", "1", "--no-trace", "--threads", "1", "--out", out],
                       tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (out / "profile.json").is_file()
    summary = f"profile: {out / 'profile.json'} and profile.html (1 steps"
    assert (proc.stdout + proc.stderr).count(summary) == 1, proc.stdout + proc.stderr


def test_overrides_may_follow_a_flag():
    """An override after a flag (--debug trainer.seed=x) is an override, not an unrecognized
    argument: the config error it causes is raised, with --debug in effect."""
    from dapo_trainer.demo.__main__ import parse_args as demo_args
    from dapo_trainer.train import main, parse_args

    assert parse_args(["a.b=1", "--debug", "trainer.seed=3"]).overrides == ["a.b=1", "trainer.seed=3"]
    assert demo_args(["a.b=1", "--no-report", "trainer.seed=3"]).overrides == ["a.b=1", "trainer.seed=3"]
    with pytest.raises(TypeError, match="'trainer.seed' must be int"):
        main(["--debug", "trainer.seed=x"])
