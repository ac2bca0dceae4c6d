"""The whole GPU run in one command: environment, import, every check under its own time limit,
one JSON and one markdown table. Started by ``benchmarks/gpu/device_run.sh OUT_DIR [COMMIT]``.

    python benchmarks/gpu/device_run.py OUT_DIR [--commit C] [--toy]
    python benchmarks/gpu/device_run.py --one NAME --jsonl F [--toy]     # one check, in this process

Steps: wheels in ``.whl/`` beside the checkout (or ``$DEVICE_RUN_WHEELS``) are installed with pip
``--no-index --no-deps --target`` into a scratch folder that every later step has on its
``PYTHONPATH``; ``import dapo_kernels`` is tried from outside the checkout (the installed wheel if
one was shipped) and the extension's presence recorded; ``nvidia-smi``, the commit (passed in: a
copied checkout has no ``.git``), Python / torch / Triton and the peers' versions are recorded; then
each check runs in its own process group, killed at its time limit (the rows it reported before stay:
``common.Report`` writes them as they come), so one slow check cannot eat the rest; a run-wide budget
shrinks the last limits so the whole run ends inside one device command.

Checks: ``benchmarks/gpu/check_<name>.py`` (``run(report)``) in the order of ``ORDER``, then ``aot``
(``aot.py --set test --arch 90 --check``, with ``--driver`` on a GPU: the driver's registers and
spills of each loaded cubin). ``--toy`` (or ``DEVICE_RUN_TOY=1``): the CPU rehearsal that
tests/test_device_run.py runs: the checks at toy sizes under the Triton interpreter
(``smoke_cpu.run_check``) and a small AOT set.

Environment: ``DEVICE_RUN_CHECKS`` (names, in the order to run), ``DEVICE_RUN_BUDGET_S`` (whole run,
default 540), ``DEVICE_RUN_TIMEOUT_<name>`` (one check's limit, seconds), ``DEVICE_RUN_AOT_ARGS``.

Output (at most 6 files, within the device tool's 8): device_run.json, device_run.md,
device_run.log (every step's output), nvidia-smi.txt, aot.json, aot.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# Most telling first, so a run cut short still has them; seconds each on an H200 (each check's own
# budget plus Triton compilation and autotuning).
ORDER = {"fused_linear_policy_loss": 120, "varlen_attention": 180, "packing": 45, "group_filter": 45,
         "model": 60, "aot": 120}
TOY_LIMIT_S = 120
TOY_AOT_ARGS = "--set test --arch 90 --ops varlen_attention --shard 0/17"  # one matmul case: the shape table too
GPU_AOT_ARGS = "--set test --arch 90 --jobs 12 --driver"
_PROBE = """
import importlib.metadata as md, json, os, sys
out = {"python": sys.version.split()[0]}
for name in ("torch", "triton", "liger-kernel", "flash-attn", "flash-attn-3", "transformers"):
    try:
        out[name] = md.version(name)
    except md.PackageNotFoundError:
        out[name] = None
import torch
out["cuda"] = torch.version.cuda
out["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
import dapo_kernels as dk
out["dapo_kernels"] = dk.__file__
dk.varlen_attention  # every tensor op imports without the C++ extension
try:
    import dapo_kernels._C  # noqa: F401
    out["extension"] = "importable"
except ImportError as e:
    out["extension"] = f"missing ({e}); balancing functions unavailable"
for name in os.environ.get("DEVICE_RUN_SHIPPED", "").split():  # the shipped wheels, as the checks see them
    try:
        out["shipped " + name] = md.version(name)
    except md.PackageNotFoundError:
        out["shipped " + name] = None
print("PROBE " + json.dumps(out))
"""


def check_names() -> List[str]:
    return [p.stem[len("check_"):] for p in sorted(HERE.glob("check_*.py"))] + ["aot"]


def _order() -> List[str]:
    names = check_names()
    wanted = os.environ.get("DEVICE_RUN_CHECKS", "").split()
    unknown = [w for w in wanted if w not in names]
    if unknown:
        raise ValueError(f"DEVICE_RUN_CHECKS: unknown checks {unknown}; known: {names}")
    return wanted or [n for n in ORDER if n in names] + [n for n in names if n not in ORDER]


def run_one(name: str, jsonl: str, toy: bool) -> int:
    """Run ``check_<name>.py`` in this process, rows appended to ``jsonl``; 1 if a row is FAIL."""
    sys.path[:0] = [str(ROOT), str(HERE.parent)]
    from gpu import common
    report = common.Report(jsonl=jsonl)
    if toy:
        from gpu import smoke_cpu
        smoke_cpu._fake_cuda()
        common.copy_bandwidth_gbs = lambda nbytes=1 << 20: 1.0
        smoke_cpu.run_check(name, report)
    else:
        import importlib.util
        spec = importlib.util.spec_from_file_location(f"gpu_check_{name}", HERE / f"check_{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mod.run(report)
    print("\n" + report.markdown(), flush=True)
    return 1 if report.failed else 0


def _run(cmd: List[str], limit: float, log, env: Dict[str, str], cwd=ROOT) -> tuple:
    """Run ``cmd`` in its own process group, output to ``log``; kill the group at ``limit`` s.
    Returns (exit code or None when killed, seconds, output)."""
    t0 = time.time()
    with tempfile.TemporaryFile("w+") as buf:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=buf, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=max(limit, 1))
        except subprocess.TimeoutExpired:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=10)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
            rc = None
        buf.seek(0)
        out = buf.read()
    log.write(f"$ {shlex.join(cmd)}\n{out}\n[{'killed at its time limit' if rc is None else f'exit {rc}'}, "
              f"{time.time() - t0:.1f} s]\n\n")
    log.flush()
    return rc, time.time() - t0, out


def _install_wheels(site: pathlib.Path, log, env) -> dict:
    folder = pathlib.Path(os.environ.get("DEVICE_RUN_WHEELS", ROOT / ".whl"))
    wheels = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    if not wheels:
        return {"folder": str(folder), "installed": [], "status": "none shipped"}
    installed, failed = [], {}
    for wheel in wheels:  # one at a time: a wheel pip refuses (another Python's tag) blocks no other
        rc, _, out = _run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--no-cache-dir", "--upgrade", "--target", str(site), str(wheel)], 120, log, env)
        if rc == 0:
            installed.append(wheel.name)
        else:
            failed[wheel.name] = f"exit {rc}: {out.strip()[-200:]}"
    return {"folder": str(folder), "installed": installed, "failed": failed,
            "status": "ok" if not failed else f"{len(failed)} of {len(wheels)} failed"}


def _nvidia_smi(out_dir: pathlib.Path, log, env) -> Optional[str]:
    try:
        full = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=60).stdout
        query = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,"
                                "clocks.mem,power.draw,power.limit,temperature.gpu", "--format=csv"],
                               capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        log.write(f"nvidia-smi: {e}\n")
        return None
    (out_dir / "nvidia-smi.txt").write_text(full + "\n" + query)
    return query.strip()


def _check(name: str, limit: float, toy: bool, out_dir: pathlib.Path, scratch: pathlib.Path, log, env) -> dict:
    if name == "aot":
        args = os.environ.get("DEVICE_RUN_AOT_ARGS", TOY_AOT_ARGS if toy else GPU_AOT_ARGS)
        cmd = [sys.executable, str(HERE / "aot.py"), *shlex.split(args), "--check",
               "--json", str(out_dir / "aot.json"), "--markdown", str(out_dir / "aot.md")]
        aot_env = {k: v for k, v in env.items() if k != "TRITON_INTERPRET"}
        rc, seconds, out = _run(cmd, limit, log, aot_env)
        breaks = next((ln for ln in out.splitlines() if ln.startswith("rule breaks outside EXCEPTIONS")), "")
        n = len(json.loads((out_dir / "aot.json").read_text())) if (out_dir / "aot.json").exists() else 0
        rows = [dict(op="aot", case=args, impl="aot.py", ms=None, metric=f"{n} kernels compiled; {breaks}",
                     status="ok" if rc == 0 else "FAIL", note="" if rc is not None else "time limit")]
    else:
        jsonl = scratch / f"{name}.jsonl"
        cmd = [sys.executable, str(HERE / "device_run.py"), "--one", name, "--jsonl", str(jsonl), *(["--toy"] * toy)]
        rc, seconds, out = _run(cmd, limit, log, env)
        rows = [json.loads(ln) for ln in jsonl.read_text().splitlines()] if jsonl.exists() else []
    failed = any(r["status"] == "FAIL" for r in rows)
    status = "timeout" if rc is None else "FAIL" if failed else "crash" if rc else "ok"
    print(f"== {name}: {status} in {seconds:.0f} s (limit {limit:.0f} s), {len(rows)} rows", flush=True)
    return dict(name=name, status=status, exit_code=rc, seconds=round(seconds, 1), limit_s=round(limit, 1),
                rows=rows, output_tail=out[-3000:] if status != "ok" else "")


def markdown(result: dict, out_dir: pathlib.Path) -> str:
    env = result["environment"]
    lines = [f"# Device run {result['date']}, commit {result['commit']}", "",
             f"GPU: {env.get('gpu')} | nvidia-smi: {result.get('nvidia_smi') or 'not found'}".replace("\n", "; "),
             f"python {env.get('python')} | torch {env.get('torch')} (CUDA {env.get('cuda')}) | triton "
             f"{env.get('triton')} | liger-kernel {env.get('liger-kernel') or 'not installed'} | flash-attn "
             f"{env.get('flash-attn') or 'not installed'} | dapo_kernels {env.get('dapo_kernels')} | extension "
             f"{env.get('extension')} | wheels: {result['wheels']['status']} {result['wheels']['installed']}",
             f"mode: {'toy (CPU rehearsal, interpreter; nothing here is a GPU figure)' if result['toy'] else 'GPU'}"
             f" | status: {result['status']}", "",
             "| check | status | seconds (limit) | rows | FAIL rows |", "|---|---|---|---|---|"]
    for c in result["checks"]:
        fails = sum(r["status"] == "FAIL" for r in c["rows"])
        lines.append(f"| {c['name']} | {c['status']} | {c['seconds']} ({c['limit_s']}) | {len(c['rows'])} | {fails} |")
    lines += ["", "| op | case | impl | time (ms) | metric | status | note |", "|---|---|---|---|---|---|---|"]
    for c in result["checks"]:
        for r in c["rows"]:
            ms = "" if r["ms"] is None else f"{r['ms']:.3f}"
            lines.append(f"| {r['op']} | {r['case']} | {r['impl']} | {ms} | {r['metric']} | {r['status']} | "
                         f"{r['note']} |")
    if (out_dir / "aot.json").exists():
        sys.path.insert(0, str(HERE.parent))
        from gpu import aot, aot_model
        try:
            records = [aot.Record(**r) for r in json.loads((out_dir / "aot.json").read_text())]
        except (ValueError, TypeError) as e:  # a half-written file from a killed aot.py: the table says so
            records, lines = [], lines + ["", f"aot.json unreadable: {e}"]
        if any(r.kernel in aot.MATMUL_KERNELS for r in records):
            lines += ["", "AOT instruction shapes, occupancy and the model's estimate:", "", aot.shapes_table(records),
                      "", aot_model.summarize(records)]
    return "\n".join(lines) + "\n"


def main(out_dir: pathlib.Path, commit: str, toy: bool) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("aot.json", "aot.md", "nvidia-smi.txt"):  # only this run's files are read back
        (out_dir / stale).unlink(missing_ok=True)
    t_start = time.time()
    budget = float(os.environ.get("DEVICE_RUN_BUDGET_S", 540))
    order = _order()
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="device_run_"))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if toy:
        env["TRITON_INTERPRET"] = "1"
    result = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), commit=commit,
                  toy=toy, checks=[])
    with open(out_dir / "device_run.log", "w") as log:
        result["wheels"] = _install_wheels(scratch / "site", log, env)
        if result["wheels"]["installed"]:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(scratch / "site"), env.get("PYTHONPATH")]))
            env["DEVICE_RUN_SHIPPED"] = " ".join(w.split("-")[0] for w in result["wheels"]["installed"])
        result["nvidia_smi"] = _nvidia_smi(out_dir, log, env)
        probe_env = dict(env, PYTHONPATH=os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(ROOT)])))
        rc, _, out = _run([sys.executable, "-c", _PROBE], 120, log, probe_env, cwd=scratch)
        found = [ln[len("PROBE "):] for ln in out.splitlines() if ln.startswith("PROBE ")]
        result["environment"] = json.loads(found[0]) if found else {"import_error": out.strip()[-500:]}
        for name in order:
            left = budget - (time.time() - t_start)
            limit = float(os.environ.get(f"DEVICE_RUN_TIMEOUT_{name}", TOY_LIMIT_S if toy else ORDER.get(name, 60)))
            if left < 10:
                result["checks"].append(dict(name=name, status="skipped", exit_code=None, seconds=0, limit_s=0,
                                             rows=[], output_tail="run budget spent"))
                continue
            result["checks"].append(_check(name, min(limit, left), toy, out_dir, scratch, log, env))
            result["status"] = "running"
            (out_dir / "device_run.json").write_text(json.dumps(result, indent=1))  # a cut-off run keeps these
    bad = [c["name"] for c in result["checks"] if c["status"] != "ok"]
    result["status"] = ("ok" if found and not bad else
                        "import failed" if not found else f"not ok: {', '.join(bad)}")
    result["seconds"] = round(time.time() - t_start, 1)
    (out_dir / "device_run.json").write_text(json.dumps(result, indent=1))
    table = markdown(result, out_dir)
    (out_dir / "device_run.md").write_text(table)
    print("\n" + table, flush=True)
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", nargs="?")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--toy", action="store_true", default=os.environ.get("DEVICE_RUN_TOY") == "1")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--jsonl", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        sys.exit(run_one(a.one, a.jsonl, a.toy))
    if not a.out_dir:
        ap.error("OUT_DIR is required")
    sys.exit(main(pathlib.Path(a.out_dir).resolve(), a.commit, a.toy))
