"""The whole GPU run in one command: environment, import, every check under its own time limit,
one JSON and one markdown table. Started by ``benchmarks/gpu/device_run.sh OUT_DIR [COMMIT]``.

    python benchmarks/gpu/device_run.py OUT_DIR [--commit C] [--toy]
    python benchmarks/gpu/device_run.py --one NAME --jsonl F [--toy]     # one check, in this process

Steps: wheels in ``.whl/`` beside the checkout (or ``$DEVICE_RUN_WHEELS``) are installed with pip
``--no-index --no-deps --target`` into a scratch folder that every later step has on its
``PYTHONPATH``; ``import dapo_kernels`` is tried from outside the checkout (the installed wheel if
one was shipped) and the extension's presence recorded; ``nvidia-smi``, the commit (passed in: a
copied checkout has no ``.git``), Python / torch / Triton and the peers' versions are recorded; then
each check runs in its own process group (in this process's session: never a session of its own, which
would outlive a kill of the device command and keep holding the GPU), the whole group killed at its time
limit and after it returns (the rows it reported before stay: ``common.Report`` writes them as they
come), so one slow check cannot eat the rest; a run-wide budget shrinks the last limits so the whole run
ends inside one device command. Killed from outside (SIGTERM / SIGINT / SIGHUP), the run kills the
running check's group and still writes its files. Inside a check every section is isolated
(``Report.section``): an exception costs that section one FAIL row carrying the error.

Checks: ``benchmarks/gpu/check_<name>.py`` (``run(report)``) in the order of ``ORDER``, then ``aot``
(``aot.py --set test --arch 90 --check``, with ``--driver`` on a GPU: the driver's registers and
spills of each loaded cubin), its records appended to a scratch file per kernel as they compile, so a
killed or failed AOT step still leaves ``aot.json`` with the kernels it finished. ``--toy`` (or
``DEVICE_RUN_TOY=1``): the CPU rehearsal that tests/test_device_run.py runs: the checks at toy sizes
under the Triton interpreter (``smoke_cpu.run_check``) and a small AOT set.

Table (device_run.md): environment, one row per check, the correctness rows first (untimed rows), then
the model's predictions beside the measurements of the same problem (aot_model's reference problems:
attention D=128 causal bf16 one 16k sequence, ``check_varlen_attention.MODEL_PROBLEM``; the fused loss at
N=16384, H=4096, V=151936) with a measured / predicted column, then every timed row.

Environment: ``DEVICE_RUN_CHECKS`` (names, in the order to run), ``DEVICE_RUN_BUDGET_S`` (whole run,
default 540), ``DEVICE_RUN_TIMEOUT_<name>`` (one check's limit, seconds), ``DEVICE_RUN_AOT_ARGS``;
rehearsals and tests: ``DEVICE_RUN_FAULT=check:function[:hang]`` makes that module-level function of the
check raise (or hang beside a child that ignores SIGTERM), ``DEVICE_RUN_FAULT_PIDS=F`` appends the
hanging processes' ids and session to ``F``.

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


_HANG_CHILD = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(3600)"


def _fault(name: str):
    """``prepare(module)`` applying ``DEVICE_RUN_FAULT`` to check ``name`` (None when it names another)."""
    check, _, rest = os.environ.get("DEVICE_RUN_FAULT", "").partition(":")
    func, _, kind = rest.partition(":")
    if check != name:
        return None

    def broken(*args, **kwargs):
        if kind == "hang":  # a stuck check with a child that ignores SIGTERM: the time limit must end both
            child = subprocess.Popen([sys.executable, "-c", _HANG_CHILD])
            if os.environ.get("DEVICE_RUN_FAULT_PIDS"):
                with open(os.environ["DEVICE_RUN_FAULT_PIDS"], "a") as f:
                    f.write(f"{os.getpid()} {child.pid} {os.getsid(0)}\n")
            time.sleep(3600)
        raise RuntimeError(f"forced failure of check_{name}.{func} (DEVICE_RUN_FAULT)")

    def prepare(mod) -> None:
        if not callable(getattr(mod, func, None)):
            raise SystemExit(f"DEVICE_RUN_FAULT: check_{name}.py has no function {func!r}")
        setattr(mod, func, broken)

    return prepare


def run_one(name: str, jsonl: str, toy: bool) -> int:
    """Run ``check_<name>.py`` in this process, rows appended to ``jsonl``; 1 if a row is FAIL. An exception
    escaping the check's own sections is one more FAIL row (the rows before it are kept)."""
    sys.path[:0] = [str(ROOT), str(HERE.parent)]
    from gpu import common
    report = common.Report(jsonl=jsonl)
    prepare = _fault(name)
    with report.section(name, "check", impl="run"):
        if toy:
            from gpu import smoke_cpu
            smoke_cpu._fake_cuda()
            common.copy_bandwidth_gbs = lambda nbytes=1 << 20: 1.0
            smoke_cpu.run_check(name, report, prepare)
        else:
            import importlib.util
            spec = importlib.util.spec_from_file_location(f"gpu_check_{name}", HERE / f"check_{name}.py")
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            if prepare:
                prepare(mod)
            mod.run(report)
    print("\n" + report.markdown(), flush=True)
    return 1 if report.failed else 0


class _Killed(Exception):
    """SIGTERM / SIGINT / SIGHUP reached the run: the running check's group is killed, the files written."""


def _on_signal(signum, frame):
    raise _Killed(signal.Signals(signum).name)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process group led by ``proc``, give it 5 s, then SIGKILL whatever is left of it (children
    that ignore SIGTERM, or that outlived their parent); the leader is reaped on the way."""
    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.time() + grace
        while time.time() < deadline:
            proc.poll()  # (an unreaped leader would keep the group alive)
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


def _run(cmd: List[str], limit: float, log, env: Dict[str, str], cwd=ROOT) -> tuple:
    """Run ``cmd`` in its own process group, output to ``log``; kill the group at ``limit`` s.
    Returns (exit code or None when killed, seconds, output)."""
    t0 = time.time()
    with tempfile.TemporaryFile("w+") as buf:
        # Its own process group (killed whole), in this session (os.setpgrp, not start_new_session).
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=buf, stderr=subprocess.STDOUT, preexec_fn=os.setpgrp)
        try:
            rc = proc.wait(timeout=max(limit, 1))
        except subprocess.TimeoutExpired:
            rc = None
        finally:  # time limit, a signal to this run, or a normal exit: nothing of the group stays behind
            _kill_group(proc)
            proc.wait()
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
        cmd = [sys.executable, str(HERE / "aot.py"), *shlex.split(args), "--check", "--jsonl",
               str(scratch / "aot.jsonl"), "--json", str(out_dir / "aot.json"), "--markdown", str(out_dir / "aot.md")]
        aot_env = {k: v for k, v in env.items() if k != "TRITON_INTERPRET"}
        rc, seconds, out = _run(cmd, limit, log, aot_env)
        breaks = next((ln for ln in out.splitlines() if ln.startswith("rule breaks outside EXCEPTIONS")), "")
        kept = _keep_aot(out_dir, scratch)
        n = len(json.loads((out_dir / "aot.json").read_text())) if (out_dir / "aot.json").exists() else 0
        note = "time limit" if rc is None else "" if rc == 0 else f"exit {rc}"
        rows = [dict(op="aot", case=args, impl="aot.py", ms=None, status="ok" if rc == 0 else "FAIL",
                     metric=f"{n} kernels compiled; {breaks or 'no summary'}",
                     note=note + ("; kept the kernels compiled before it stopped" if kept else ""))]
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


def _keep_aot(out_dir: pathlib.Path, scratch: pathlib.Path) -> bool:
    """Where aot.py stopped before writing aot.json (killed, crashed), write aot.json and aot.md from the
    records it appended per kernel; True if it did."""
    if (out_dir / "aot.json").exists():
        return False
    sys.path.insert(0, str(HERE.parent))
    from gpu import aot
    records = aot.read_jsonl(str(scratch / "aot.jsonl"))
    if records:
        aot.write_files(records, str(out_dir / "aot.json"), str(out_dir / "aot.md"))
    return bool(records)


def _row_cell(r: dict) -> str:
    ms = "" if r["ms"] is None else f"{r['ms']:.3f}"
    return f"| {r['op']} | {r['case']} | {r['impl']} | {ms} | {r['metric']} | {r['status']} | {r['note']} |"


def _measured(rows: List[dict], op: str, impl: str, case_start: str, case_end: str) -> Optional[dict]:
    return next((r for r in rows if r["op"] == op and r["impl"] == impl and r["case"].startswith(case_start)
                 and r["case"].endswith(case_end) and r.get("tflops")), None)


def comparison(rows: List[dict], records) -> List[str]:
    """Predicted (aot_model, from this run's AOT records) beside measured TFLOP/s of the same problems, with
    measured / predicted; a side not there reads '-'."""
    sys.path.insert(0, str(HERE.parent))
    from gpu import aot_model
    est = aot_model.estimates(records)
    attn = est.get(("varlen_attention", "bfloat16", "D=128 causal"), {})
    lm = next((v for (op, dtype, _), v in est.items() if op == "linear_log_probs" and dtype == "bfloat16"), {})
    pairs = [("attention fwd", attn.get("fwd"), _measured(rows, "varlen_attn", "dk det=False", "model ", " fwd")),
             ("attention bwd, atomic dQ (det=False)", attn.get("bwd_atomic") or attn.get("bwd_det"),
              _measured(rows, "varlen_attn", "dk det=False", "model ", " bwd")),
             ("attention bwd, dQ kernel (det=True)", attn.get("bwd_det"),
              _measured(rows, "varlen_attn", "dk det=True", "model ", " bwd")),
             ("fused loss fwd+bwd", lm.get("tflops"), _measured(rows, "fused_loss", "dk triton", "N", "fwd+bwd"))]
    lines = ["| pass | predicted on | predicted TFLOP/s | measured on | measured TFLOP/s | measured / predicted |",
             "|---|---|---|---|---|---|"]
    for name, pred, meas in pairs:
        problem = (attn if name.startswith("attention") else lm).get("problem", "-")
        got = meas["tflops"] if meas else None
        cells = [f"{pred:.0f}" if pred else "-", meas["case"] if meas else "-", f"{got:.0f}" if got else "-",
                 f"{got / pred:.2f}" if pred and got else "-"]
        lines.append(f"| {name} | {problem} | " + " | ".join(cells) + " |")
    return lines


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
    rows = [r for c in result["checks"] for r in c["rows"]]
    # First: the correctness rows (untimed, not skipped) and every FAIL row.
    untimed = [r for r in rows if r["status"] == "FAIL" or (r["ms"] is None and r["status"] == "ok")]
    head = ["| op | case | impl | time (ms) | metric | status | note |", "|---|---|---|---|---|---|---|"]
    lines += ["", f"Correctness and failures ({sum(r['status'] == 'FAIL' for r in rows)} FAIL rows):", "", *head,
              *(_row_cell(r) for r in untimed)]
    sys.path.insert(0, str(HERE.parent))
    from gpu import aot, aot_model
    records = []
    if (out_dir / "aot.json").exists():
        try:
            records = [aot.Record(**r) for r in json.loads((out_dir / "aot.json").read_text())]
        except (ValueError, TypeError) as e:  # a half-written file from a killed aot.py: the table says so
            lines += ["", f"aot.json unreadable: {e}"]
    lines += ["", "Predicted (aot_model, an estimate) beside measured, the same problem:", "",
              *comparison(rows, records), "", "Every other row:", "", *head,
              *(_row_cell(r) for r in rows if all(r is not u for u in untimed))]
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
                  toy=toy, checks=[], wheels=dict(status="not reached", installed=[]), environment={})
    found = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    with open(out_dir / "device_run.log", "w") as log:
        try:
            found = _steps(result, order, toy, budget, t_start, out_dir, scratch, log, env)
        except _Killed as e:  # from outside: the check's group is dead (_run); keep its rows and write the files
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)
            done = {c["name"] for c in result["checks"]}
            name = next((n for n in order if n not in done), "") if result["environment"] else ""
            jsonl = scratch / f"{name}.jsonl"
            rows = [json.loads(ln) for ln in jsonl.read_text().splitlines()] if jsonl.exists() else []
            kept = name == "aot" and _keep_aot(out_dir, scratch)
            result["checks"].append(dict(name=name, status=f"killed ({e})", exit_code=None, seconds=0, limit_s=0,
                                         rows=rows, output_tail="aot.json kept" if kept else ""))
            result["killed"] = f"{e} during {name or 'setup'}"
            log.write(f"\nkilled from outside: {result['killed']}\n")
    bad = [c["name"] for c in result["checks"] if c["status"] != "ok"]
    result["status"] = ("ok" if found and not bad else
                        "import failed" if not found else f"not ok: {', '.join(bad)}")
    if result.get("killed"):
        result["status"] = f"killed from outside ({result['killed']})"
    result["seconds"] = round(time.time() - t_start, 1)
    (out_dir / "device_run.json").write_text(json.dumps(result, indent=1))
    table = markdown(result, out_dir)
    (out_dir / "device_run.md").write_text(table)
    print("\n" + table, flush=True)
    return 0 if result["status"] == "ok" else 1


def _steps(result, order, toy, budget, t_start, out_dir, scratch, log, env):
    """Wheels, nvidia-smi, the import probe, then every check into ``result``; the probe's output lines."""
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
    return found


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
