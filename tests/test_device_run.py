"""``benchmarks/gpu/device_run.sh``, the whole GPU run in one command, runs end to end on the CPU
(``DEVICE_RUN_TOY=1``: checks at toy sizes under the Triton interpreter, a small AOT set) and
writes its JSON and markdown table: wheels shipped beside the checkout are installed and seen by
the checks (one pip refuses is recorded and blocks no other), the commit passed in is recorded, a
check that outlives its time limit is killed and reported while the checks after it still run, a
section forced to fail costs one row, a killed AOT step keeps the kernels it compiled, and neither a
time limit nor a kill of the run leaves a process behind."""
import base64
import hashlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu" / "device_run.sh"
AOT = ROOT / "benchmarks" / "gpu" / "aot.py"
sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu import aot, device_run  # noqa: E402

TOY_AOT = device_run.TOY_AOT_ARGS


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
               DEVICE_RUN_CHECKS="model packing aot", DEVICE_RUN_TIMEOUT_model="2",
               DEVICE_RUN_FAULT="packing:copy_bandwidth_gbs")  # one section of packing forced to fail
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
    assert status == {"model": "timeout", "packing": "FAIL", "aot": "ok"}, status
    assert result["status"] == "not ok: model, packing"
    packing = next(c for c in result["checks"] if c["name"] == "packing")
    failed = [r for r in packing["rows"] if r["status"] != "ok"]
    assert [(r["case"], r["status"]) for r in failed] == [("device copy bandwidth", "FAIL")], failed
    assert "forced failure of check_packing.copy_bandwidth_gbs" in failed[0]["note"]
    assert len(packing["rows"]) > 8 and any(r["impl"] == "dk triton vs peer recipe" for r in packing["rows"])
    records = json.loads((out / "aot.json").read_text())
    assert any(any(k.startswith("wgmma n") for s in r["dots"].values() for k in s) for r in records)
    table = (out / "device_run.md").read_text()
    assert "| model | timeout |" in table and "| packing | FAIL |" in table and "commit abc1234" in table
    assert "dapo::index_rows" in table  # the packing rows after the failed one
    assert table.index("forced failure") < table.index("| pass | predicted on |") < table.index("dapo::index_rows")
    assert "predicted TFLOP/s" in table  # the AOT shape table with the model's estimate
    assert (out / "device_run.log").stat().st_size > 0


def test_device_run_usage():
    """Without an output directory the script says how to call it and exits 2."""
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "usage: bash benchmarks/gpu/device_run.sh OUT_DIR [COMMIT]" in proc.stderr


def _toy_run(out, **env_vars):
    env = dict(os.environ, DEVICE_RUN_TOY="1", PYTHON=sys.executable, **env_vars)
    return subprocess.Popen(["bash", str(SCRIPT), str(out), "abc1234"], cwd=out.parent, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_device_run_keeps_the_kernels_a_killed_aot_step_compiled(tmp_path):
    """aot.py killed after its second kernel (SIGKILL, as a time limit or a crash would): the run still writes
    aot.json with those two records, the AOT tables with their predictions, and a FAIL row that says so."""
    proc = _toy_run(tmp_path / "out", DEVICE_RUN_CHECKS="aot", DEVICE_RUN_AOT_ARGS=TOY_AOT + " --die-after 2")
    log = proc.communicate(timeout=300)[0]
    assert proc.returncode == 1, log[-3000:]
    records = json.loads((tmp_path / "out" / "aot.json").read_text())
    assert len(records) == 2 and all(r["model"] for r in records), records
    row = json.loads((tmp_path / "out" / "device_run.json").read_text())["checks"][0]["rows"][0]
    assert row["status"] == "FAIL" and row["metric"].startswith("2 kernels compiled") and "kept" in row["note"], row
    table = (tmp_path / "out" / "device_run.md").read_text()
    assert "predicted TFLOP/s (estimate)" in table and "| attn_fwd_kernel |" in table


def test_aot_jobs_keep_a_failed_workers_kernels(tmp_path):
    """With --jobs, a worker that dies keeps the kernels it compiled (appended per kernel): the merged JSON
    holds every worker's records and the run exits 1 naming the failed workers."""
    out = tmp_path / "aot.json"
    proc = subprocess.run([sys.executable, str(AOT), "--set", "test", "--arch", "90", "--ops", "varlen_attention",
                           "--jobs", "2", "--die-after", "1", "--json", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "aot worker 0/2 failed" in proc.stderr and "aot worker 1/2 failed" in proc.stderr, proc.stderr[-3000:]
    records = json.loads(out.read_text())
    assert sorted(r["case"] for r in records) == [0, 1], records


def test_read_jsonl_skips_a_line_cut_by_a_kill(tmp_path):
    """read_jsonl reads the file and its workers' F.i files, skipping a last line a killed writer cut short."""
    rec = dict(kernel="k", config="", op="op", dtype="bfloat16", inputs="D=16", arch=90)
    (tmp_path / "a.jsonl").write_text(json.dumps(rec) + "\n" + json.dumps(rec)[:20])
    (tmp_path / "a.jsonl.1").write_text(json.dumps(dict(rec, case=3)) + "\n")
    (tmp_path / "a.jsonl.old").write_text(json.dumps(rec) + "\n")  # not a worker's file
    assert [r.case for r in aot.read_jsonl(str(tmp_path / "a.jsonl"))] == [0, 3]


def _gone(pid: int) -> bool:
    """The process has exited (a zombie awaiting an absent reaper counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _hang_pids(path: pathlib.Path, timeout: float = 240) -> list:
    """(check pid, its child's pid, the check's session) once the hanging check has written them."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and path.read_text().endswith("\n"):
            return [int(x) for x in path.read_text().split()]
        time.sleep(0.5)
    raise AssertionError(f"the hanging check never started ({path})")


def test_a_timeout_leaves_no_process_behind(tmp_path):
    """A check that hangs beside a child ignoring SIGTERM is killed at its time limit with that child (its
    whole process group); it ran in the run's session, not one of its own that would outlive the command."""
    pids = tmp_path / "pids"
    proc = _toy_run(tmp_path / "out", DEVICE_RUN_CHECKS="packing", DEVICE_RUN_FAULT="packing:run:hang",
                    DEVICE_RUN_FAULT_PIDS=str(pids), DEVICE_RUN_TIMEOUT_packing="90")
    log = proc.communicate(timeout=300)[0]
    check, child, session = _hang_pids(pids, timeout=1)
    assert session == os.getsid(0), "the check ran in a session of its own"
    assert _gone(check) and _gone(child), (check, child, log[-2000:])
    result = json.loads((tmp_path / "out" / "device_run.json").read_text())
    assert result["checks"][0]["status"] == "timeout" and proc.returncode == 1


def test_a_run_killed_from_outside_kills_its_check_and_writes_its_files(tmp_path):
    """SIGTERM to the run while a check hangs: the check and its SIGTERM-ignoring child end, and the JSON and
    table are still written, saying the run was killed and during which check."""
    pids = tmp_path / "pids"
    proc = _toy_run(tmp_path / "out", DEVICE_RUN_CHECKS="packing", DEVICE_RUN_FAULT="packing:run:hang",
                    DEVICE_RUN_FAULT_PIDS=str(pids), DEVICE_RUN_TIMEOUT_packing="300")
    try:
        check, child, _ = _hang_pids(pids)
        proc.send_signal(signal.SIGTERM)  # (bash execs python: this is device_run.py)
        log = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
    deadline = time.time() + 10
    while not (_gone(check) and _gone(child)) and time.time() < deadline:
        time.sleep(0.2)
    assert _gone(check) and _gone(child), (check, child, log[-2000:])
    result = json.loads((tmp_path / "out" / "device_run.json").read_text())
    assert proc.returncode == 1 and result["status"] == "killed from outside (SIGTERM during packing)", result
    assert (tmp_path / "out" / "device_run.md").read_text().count("killed") >= 1


def test_predictions_sit_beside_measurements_of_the_same_problem():
    """The comparison table pairs aot_model's estimates with the measured rows of its reference problems and
    gives measured / predicted; a side that is missing reads '-'."""
    def rec(kernel, ms, config=""):
        return aot.Record(kernel, config, "varlen_attention", "bfloat16", "D=128 causal", 90, model=dict(
            problem="T=16384 Hq=32 Hkv=8 causal", flops_per_dot=1e12, ms=ms, tflops=2e12 / ms / 1e9 if ms else 0.0))
    records = [rec("_varlen_attention_fwd_kernel", 4.0), rec("_varlen_attention_bwd_delta_kernel", 0.0),
               rec("_varlen_attention_bwd_dkdv_kernel", 10.0, "ATOMIC_DQ=True"),
               rec("_varlen_attention_bwd_dkdv_kernel", 6.0, "ATOMIC_DQ=False"),
               rec("_varlen_attention_bwd_dq_kernel", 4.0)]
    rows = [dict(op="varlen_attn", case="model B1 T16384 fwd", impl="dk det=False", ms=1.0, tflops=250.0),
            dict(op="varlen_attn", case="model B1 T16384 bwd", impl="dk det=False", ms=1.0, tflops=400.0),
            dict(op="varlen_attn", case="RL-mix B9 T65536 fwd", impl="dk det=False", ms=1.0, tflops=999.0)]
    table = "\n".join(device_run.comparison(rows, records))
    assert "| attention fwd | T=16384 Hq=32 Hkv=8 causal | 500 | model B1 T16384 fwd | 250 | 0.50 |" in table
    assert "| attention bwd, atomic dQ (det=False) | T=16384 Hq=32 Hkv=8 causal | 500 | model B1 T16384 bwd | 400 | " \
           "0.80 |" in table
    assert "| attention bwd, dQ kernel (det=True) | T=16384 Hq=32 Hkv=8 causal | 500 | - | - | - |" in table
    assert "| fused loss fwd+bwd | - | - | - | - | - |" in table
