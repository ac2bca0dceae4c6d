"""Shared pieces of the GPU checks: the report table, isolated sections and CUDA timing."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import traceback
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch


@dataclass
class Row:
    op: str
    case: str
    impl: str = ""
    ms: Optional[float] = None
    metric: str = ""
    status: str = "ok"
    note: str = ""
    tflops: Optional[float] = None  # measured rate where the row has a FLOP count (device_run's predicted vs measured)


@dataclass
class Report:
    rows: List[Row] = field(default_factory=list)
    # Each row is also appended here as one JSON line when it is added: a check killed by its time
    # limit (benchmarks/gpu/device_run.py) keeps the rows it reported.
    jsonl: Optional[str] = None

    def add(self, op, case, *, impl="", ms=None, metric="", status="ok", note="", tflops=None):
        self.rows.append(Row(op, case, impl, ms, metric, status, note, tflops))
        if self.jsonl:
            with open(self.jsonl, "a") as f:
                f.write(json.dumps(dataclasses.asdict(self.rows[-1])) + "\n")
        print(f"   {op:14s} {case:28s} {impl:18s} {'' if ms is None else f'{ms:9.3f} ms'} {metric} {status} {note}",
              flush=True)

    @contextlib.contextmanager
    def section(self, op, case, impl=""):
        """One isolated part of a check: an exception inside becomes one FAIL row carrying its error (the
        traceback goes to stderr, the run's log) and the check goes on with its next section."""
        try:
            yield
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            note = f"{type(e).__name__}: {e}"[:200].replace("\n", " ").replace("|", "/")
            self.add(op, case, impl=impl, status="FAIL", note=note)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    @property
    def failed(self) -> bool:
        return any(r.status == "FAIL" for r in self.rows)

    def markdown(self) -> str:
        lines = ["| op | case | impl | time (ms) | metric | status | note |", "|---|---|---|---|---|---|---|"]
        for r in self.rows:
            ms = "" if r.ms is None else f"{r.ms:.3f}"
            lines.append(f"| {r.op} | {r.case} | {r.impl} | {ms} | {r.metric} | {r.status} | {r.note} |")
        return "\n".join(lines)


def cuda_time_ms(fn: Callable[[], object], *, warmup: int = 3, iters: int = 10) -> float:
    """Median wall time of fn() in ms, measured with CUDA events after warm-up."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Measured device-to-device copy bandwidth (read + write bytes per second)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src))
    src = dst = None  # free them (the lambda above closes over the names)
    return 2 * nbytes / ms / 1e6


def peak_mem_mb(fn: Callable[[], object]) -> float:
    """Peak extra CUDA memory (MiB) allocated while running fn()."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20
