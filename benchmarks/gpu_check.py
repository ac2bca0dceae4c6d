"""One-shot GPU check: correctness and timing of every Triton op against its peers.

Run on a CUDA machine (the H200 lent through the device tool):

    python benchmarks/gpu_check.py            # all checks, DEFAULT_ORDER first
    python benchmarks/gpu_check.py packing    # only checks whose name contains 'packing'
    python benchmarks/gpu_check.py fused_linear_policy_loss varlen_attention   # those two, in that order

Each op family contributes ``benchmarks/gpu/check_<op>.py`` with a function
``run(report)``; this script discovers them, runs each under a time budget, and prints
one table last (also written to ``$OUT/gpu_check.md`` when ``OUT`` is set, after every check). A failing
check is reported as a FAIL row and the others still run.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import pathlib
import subprocess
import sys
import time
import traceback

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from gpu.common import Report  # noqa: E402

# Without arguments, the checks that matter most run first, so that a run cut off by its time
# limit still has them; any other check follows in name order.
DEFAULT_ORDER = ("fused_linear_policy_loss", "varlen_attention", "packing", "group_filter", "model")


def _git_commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, text=True).strip()
    except Exception:
        return "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("only", nargs="*", help="substrings of check names to run")
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("gpu_check.py needs a CUDA device; none found", file=sys.stderr)
        return 2
    report = Report()
    header = (
        f"date {datetime.date.today()} | GPU {torch.cuda.get_device_name()} | torch {torch.__version__} | "
        f"triton {__import__('triton').__version__} | commit {_git_commit()}"
    )
    names = {p.stem[len("check_"):]: p for p in sorted((HERE / "gpu").glob("check_*.py"))}
    checks = _ordered(names, args.only or [*DEFAULT_ORDER, *names])
    for path in checks:
        name = path.stem[len("check_"):]
        t0 = time.time()
        print(f"== {name}", flush=True)
        try:
            spec = importlib.util.spec_from_file_location(f"gpu_check_{name}", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            mod.run(report)
        except Exception as e:  # keep going: one broken op must not hide the others
            traceback.print_exc()
            report.add(name, "check crashed", status="FAIL", note=f"{type(e).__name__}: {e}"[:120])
        torch.cuda.empty_cache()
        print(f"   {name}: {time.time() - t0:.1f}s", flush=True)
        _write(header, report)  # after every check: a run cut off by its time limit keeps what it measured
    print("\n" + _write(header, report))
    return 1 if report.failed else 0


def _ordered(names: dict, wanted) -> list:
    """The checks named in ``wanted`` order (a full name selects itself, a substring every check that
    contains it), each once: put the checks that matter most first when time is short."""
    out = []
    for w in wanted:
        out += [names[w]] if w in names else [p for n, p in names.items() if w in n]
    return list(dict.fromkeys(out))


def _write(header: str, report: Report) -> str:
    table = header + "\n\n" + report.markdown()
    out = os.environ.get("OUT")
    if out:
        pathlib.Path(out, "gpu_check.md").write_text(table + "\n")
    return table


if __name__ == "__main__":
    sys.exit(main())
