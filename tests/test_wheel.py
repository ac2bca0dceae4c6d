"""The package as users get it: build the wheel, install it into a fresh venv and
import from it, away from the source tree, then run the demo from it. Slow (compiles
dapo_kernels._C): marked ``wheel``."""
import re
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHECK = """
import importlib.metadata as md, importlib.resources as res, os, sys
import dapo_kernels as dk, dapo_trainer
for m in (dk, dapo_trainer):
    assert m.__file__.startswith(sys.prefix), (m.__file__, sys.prefix)
assert md.version("dapo-kernels") == dk.__version__, (md.version("dapo-kernels"), dk.__version__)
reqs = md.requires("dapo-kernels")
assert any(r.startswith("torch>=") for r in reqs) and not any("==" in r.split(";")[0] for r in reqs), reqs
assert any('extra == "trainer"' in r and r.startswith("pyyaml") for r in reqs), reqs
assert res.files("dapo_trainer").joinpath("configs", "demo.yaml").is_file()
parts = dk.balanced_partitions([5, 1, 4, 2], 2)  # the C++ extension from the wheel
assert sorted(i for p in parts for i in p) == [0, 1, 2, 3], parts
eps = md.entry_points(group="dapo_kernels.backends")
assert [e.value for e in eps] == ["npu_ops:register"], eps
scripts = {e.name: e.value for e in md.entry_points(group="console_scripts") if e.name.startswith("dapo-")}
assert scripts == {"dapo-report": "dapo_trainer.tools.report:main",
                   "dapo-profile": "dapo_trainer.tools.profiler:main",
                   "dapo-tune": "dapo_trainer.tools.tune:main"}, scripts
presets = res.files("dapo_trainer").joinpath("configs", "presets")
assert presets.joinpath("cpu_debug_qwen2.5-0.5b.yaml").is_file(), list(presets.iterdir())
assert presets.joinpath("models", "qwen2.5-7b", "config.json").is_file()
print("wheel ok")
"""


@pytest.mark.slow
@pytest.mark.wheel
def test_wheel_installs_and_imports(tmp_path):
    py = sys.executable
    # No PYTHONPATH: the source tree on it (the tests' own setting) would count as dapo-kernels
    # already installed (its egg-info) and shadow the wheel.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([py, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist")], check=True, timeout=600, env=env)
    (wheel,) = (tmp_path / "dist").glob("dapo_kernels-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "dapo_trainer/configs/demo.yaml" in names and any(n.startswith("dapo_kernels/_C") for n in names)
    venv = tmp_path / "venv"
    subprocess.run([py, "-m", "venv", str(venv)], check=True, timeout=300, env=env)
    vpy = venv / "bin" / "python"
    # torch / numpy / triton and the trainer extra's packages come from this interpreter's
    # site-packages, after the venv's own (this machine cannot download them): a plain path line
    # in a .pth, so that directory's own .pth files (an editable install of the source tree, say)
    # are not run. pip sees them as installed, so "wheel[trainer]" resolves offline.
    purelib = subprocess.run([str(vpy), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    host = sysconfig.get_paths()['purelib']
    Path(purelib, "zz_host_site.pth").write_text(host + "\n")
    # (the venv's own bundled setuptools would shadow the host's newer one, which torch requires)
    subprocess.run([str(vpy), "-m", "pip", "uninstall", "-q", "-y", "setuptools"], check=False, timeout=300, env=env)
    subprocess.run([str(vpy), "-m", "pip", "install", "-q", "--no-index", f"{wheel}[trainer]"], check=True,
                   timeout=300, env=env)
    out = subprocess.run([str(vpy), "-c", CHECK], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "wheel ok" in out.stdout
    # The demo from the installed package (its YAML config, tokenizer, report template), in an
    # empty directory: a short warm start and 2 DAPO steps (filter_groups off: a model this weak
    # solves no group, so dynamic sampling would keep none), then the closing line and the report.
    work = tmp_path / "demo"
    work.mkdir()
    out = subprocess.run([str(vpy), "-m", "dapo_trainer.demo", "--warm-start-steps", "40",
                          "trainer.total_training_steps=2", "trainer.test_freq=1",
                          "algorithm.filter_groups.enable=false"],
                         cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"held-out accuracy: before \d+\.\d% -> after \d+\.\d%", out.stdout), out.stdout[-2000:]
    assert (work / "runs" / "demo" / "seed0" / "report" / "index.html").is_file()
    assert not (work / "dapo_trainer").exists() and not (work / "dapo_kernels").exists()
