"""The package as users get it (issue 19 item 5): build the wheel, install it into a fresh venv and
import from it, away from the source tree. Slow (compiles dapo_kernels._C): marked ``wheel``."""
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
    subprocess.run([str(vpy), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                   timeout=300, env=env)
    # torch / numpy / triton come from this interpreter's site-packages, after the venv's own
    # (this machine cannot download them): a plain path line in a .pth, so that directory's own
    # .pth files (an editable install of the source tree, say) are not run.
    purelib = subprocess.run([str(vpy), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    host = sysconfig.get_paths()['purelib']
    Path(purelib, "zz_host_site.pth").write_text(host + "\n")
    out = subprocess.run([str(vpy), "-c", CHECK], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "wheel ok" in out.stdout
