"""Run every GPU check on the CPU at toy sizes, to catch a broken script before device time is spent.

    TRITON_INTERPRET=1 python benchmarks/gpu/smoke_cpu.py [names...]

Device time is scarce (minutes per task), and a check that crashes on its first line wastes
a whole machine start. This runs the same ``check_*.py`` sources with ``"cuda"`` replaced by
``"cpu"``, a host-clock stand-in for the few ``torch.cuda`` calls they make, and each
module's sizes shrunk (``SMALL`` below). Its table says nothing about speed or about the
GPU's numerics: only that every code path runs and the correctness checks hold at toy size.
"""
from __future__ import annotations

import os
import pathlib
import sys
import time
import types

os.environ.setdefault("TRITON_INTERPRET", "1")

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402


class _HostEvent:
    def __init__(self, enable_timing=False):
        self.t = None

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


def _fake_cuda():
    """The torch.cuda calls the checks make, answered on the host."""
    c = torch.cuda
    c.Event = _HostEvent
    c.synchronize = lambda *a, **k: None
    c.empty_cache = lambda: None
    c.reset_peak_memory_stats = lambda *a, **k: None
    c.memory_allocated = lambda *a, **k: 0
    c.max_memory_allocated = lambda *a, **k: 0
    c.get_device_name = lambda *a, **k: "CPU smoke"
    c.get_sync_debug_mode = lambda: 0
    c.set_sync_debug_mode = lambda mode: None


def _time_once(fn, *, warmup=0, iters=1):
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


# Per check: (source substitutions, module attributes to set after loading).
def _small():
    from dapo_trainer import ModelConfig

    tiny_model = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2,
                             num_kv_heads=1, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6, qkv_bias=True,
                             tie_word_embeddings=True, model_type="qwen2")
    return {
        "varlen_attention": ({"B, S = 16, 1024": "B, S = 2, 64", "[1000, 37, 1, 520, 77, 129]": "[40, 7, 1, 33]"},
                      dict(T_TOTAL=256, HQ=2, HKV=1, D=16, FIXED=(64, 128), MODEL_PROBLEM=[128])),
        "group_filter": ({"4096": "256", "131072": "512"}, dict(SIZES=(256, 1024))),
        "fused_linear_policy_loss": ({}, dict(N=64, H=32, V=200, N_CHECK=16, B=4)),
        "model": ({"torch.randint(256, 2049, (16,))": "torch.randint(8, 33, (3,))",
                   "[300, 17, 1024, 1]": "[30, 17, 64, 1]"},
                  dict(QWEN25_05B=tiny_model)),
        "packing": ({}, dict(B=4, S=64, CASES=((16, torch.bfloat16), (16, torch.float32), (32, torch.bfloat16)))),
    }


def check_names():
    return [p.stem[len("check_"):] for p in sorted(HERE.glob("check_*.py"))]


def run_check(name, report, prepare=None) -> None:
    """Load ``check_<name>.py`` with the CPU substitutions and toy sizes, and run it (``prepare(module)``
    first, where given: device_run.py's DEVICE_RUN_FAULT)."""
    import gpu.common as common

    path = HERE / f"check_{name}.py"
    small = _small()
    if name not in small:  # a check at GPU sizes runs for hours under the interpreter
        raise SystemExit(f"smoke: no toy sizes for {path.name}; add {name!r} to _small()")
    subs, attrs = small[name]
    src = path.read_text().replace('"cuda"', '"cpu"').replace(".cuda()", ".cpu()")
    for old, new in subs.items():
        if old not in src:
            raise SystemExit(f"smoke: {path.name} no longer contains {old!r}; update _small()")
        src = src.replace(old, new)
    mod = types.ModuleType(f"gpu_smoke_{name}")
    mod.__file__ = str(path)
    exec(compile(src, str(path), "exec"), mod.__dict__)
    for k, v in attrs.items():
        if not hasattr(mod, k):
            raise SystemExit(f"smoke: {path.name} has no {k}; update _small()")
        setattr(mod, k, v)
    # One call per timing and no time budget: every path runs once, however slow the interpreter.
    mod.__dict__["cuda_time_ms"] = _time_once
    mod.__dict__["copy_bandwidth_gbs"] = common.copy_bandwidth_gbs
    if hasattr(mod, "BUDGET_S"):
        mod.BUDGET_S = float("inf")
    if prepare is not None:
        prepare(mod)
    mod.run(report)  # no try: a crash here is what the smoke run is for (the checks' sections add FAIL rows)


def main(argv) -> int:
    from gpu.common import Report
    import gpu.common as common

    _fake_cuda()
    common.copy_bandwidth_gbs = lambda nbytes=1 << 20: 1.0
    report = Report()
    for name in check_names():
        if argv and not any(a in name for a in argv):
            continue
        t0 = time.time()
        print(f"== {name}", flush=True)
        run_check(name, report)
        print(f"   {name}: {time.time() - t0:.1f}s", flush=True)
    print("\n" + report.markdown())
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
