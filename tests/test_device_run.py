"""``benchmarks/gpu/device_run.sh``, the whole GPU run in one command, runs end to end on the CPU
(``DEVICE_RUN_TOY=1``: checks at toy sizes under the Triton interpreter, a small AOT set) and
writes its JSON and markdown table: wheels shipped beside the checkout are installed and seen by
the checks (one pip refuses is recorded and blocks no other), the commit passed in is recorded, and
a check that outlives its time limit is killed and reported while the checks after it still run."""
import base64
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu" / "device_run.sh"


def _wheel(folder: pathlib.Path) -> pathlib.Path:
    """A pure-Python wheel ``dapo_device_probe 0.1``, as a peer shipped in .whl/ would be."""
    files = {"dapo_device_probe/__init__.py": b"VALUE = 1\n",
             "dapo_device_probe-0.1.dist-info/METADATA": b"Metadata-Version: 2.1\nName: dapo_device_probe\n"
                                                         b"Version: 0.1\n",
             "dapo_device_probe-0.1.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                      b"Tag: py3-none-any\n"}
    record = "".join(f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
                     f"{len(data)}\n" for name, data in files.items()) + "dapo_device_probe-0.1.dist-info/RECORD,,\n"
    path = folder / "dapo_device_probe-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("dapo_device_probe-0.1.dist-info/RECORD", record)
    return path


def test_device_run_writes_json_and_table_and_survives_a_slow_check(tmp_path):
    wheels = tmp_path / "whl"
    wheels.mkdir()
    probe = _wheel(wheels)
    # A wheel for another Python (as a cp311 build of this package would be on the device's 3.12).
    (wheels / "dapo_other_python-0.1-cp27-cp27mu-manylinux1_x86_64.whl").write_bytes(probe.read_bytes())
    out = tmp_path / "out"
    env = dict(os.environ, DEVICE_RUN_TOY="1", DEVICE_RUN_WHEELS=str(wheels), PYTHON=sys.executable,
               DEVICE_RUN_CHECKS="model packing aot", DEVICE_RUN_TIMEOUT_model="2")
    proc = subprocess.run(["bash", str(SCRIPT), str(out), "abc1234"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 1, f"the timed-out check must make the run not ok (rc {proc.returncode}):\n{log[-3000:]}"
    result = json.loads((out / "device_run.json").read_text())
    assert result["commit"] == "abc1234" and result["toy"] is True
    assert result["wheels"]["installed"] == [probe.name], result["wheels"]
    assert list(result["wheels"]["failed"]) == ["dapo_other_python-0.1-cp27-cp27mu-manylinux1_x86_64.whl"]
    assert result["environment"]["shipped dapo_device_probe"] == "0.1", result["environment"]
    assert result["environment"]["torch"] and result["environment"]["triton"]
    assert result["environment"]["dapo_kernels"].endswith("__init__.py")
    status = {c["name"]: c["status"] for c in result["checks"]}
    assert status == {"model": "timeout", "packing": "ok", "aot": "ok"}, status
    assert result["status"] == "not ok: model"
    packing = next(c for c in result["checks"] if c["name"] == "packing")
    assert len(packing["rows"]) > 3 and all(r["status"] == "ok" for r in packing["rows"])
    records = json.loads((out / "aot.json").read_text())
    assert any(any(k.startswith("wgmma n") for s in r["dots"].values() for k in s) for r in records)
    table = (out / "device_run.md").read_text()
    assert "| model | timeout |" in table and "| packing | ok |" in table and "commit abc1234" in table
    assert "dapo::index_rows" in table  # the packing rows
    assert "predicted TFLOP/s" in table  # the AOT shape table with the model's estimate
    assert (out / "device_run.log").stat().st_size > 0


def test_device_run_usage():
    """Without an output directory the script says how to call it and exits 2."""
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "usage: bash benchmarks/gpu/device_run.sh OUT_DIR [COMMIT]" in proc.stderr
