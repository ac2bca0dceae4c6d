"""Every Triton kernel of dapo_kernels compiles for sm_90 and sm_80 on the CPU, within the chip's
shared memory, without register spills, and on Hopper every ``tl.dot`` of a 16-bit matmul kernel
(attention, fused loss) is a ``wgmma`` with N >= 64 and no ``mma.sync`` is mixed in, except the
breaks documented with their reasons in ``aot.EXCEPTIONS`` (issues 17 and 29).

No GPU is needed: ``benchmarks/gpu/aot.py`` compiles through the ops' real launchers with a
stand-in driver, in a subprocess without ``TRITON_INTERPRET`` (which this test process has), and
reads the cubins and the PTX (instruction shapes per dot from its line information). A compile
takes seconds on this CPU, so the test compiles the harness's ``--set test`` (see
``aot_cases.cases``): every kernel, with every autotune config the pruning keeps for the inputs
compiled, attention at every head dim once per dtype class with causal and non-causal
alternating. It prints the instruction-shape table with occupancy and the model's estimate.
Kernels are cached on disk (``.cache/triton-aot``): a second run takes seconds.
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu import aot, aot_model  # noqa: E402

# The dots each matmul kernel's source has (label names as aot_model.dot_sites gives them): a
# compiled 16-bit instance must show every one of them, or the per-dot rule would check nothing
# (the atomic-dQ dK/dV instance has a fifth, b_dq).
EXPECTED_DOTS = {
    "_varlen_attention_fwd_kernel": {"b_s", "b_pv"},
    "_varlen_attention_bwd_dkdv_kernel": {"b_st", "b_dv", "b_dpt", "b_dk"},
    "_varlen_attention_bwd_dq_kernel": {"b_s", "b_dp", "b_dq"},
    "_varlen_attention_fwd_hopper_kernel": {"b_s", "b_pv"},
    "_moe_gate_up_fwd_kernel": {"acc_g", "acc_u"},
    "_moe_rows_gemm_kernel": {"acc"},
    "_moe_gate_up_bwd_kernel": {"acc"},
    "_moe_weight_grad_kernel": {"acc"},
}

_PTX = """
	.loc	1 10 5
	mov.u32 	%r1, 0;
	// begin inline asm
	.loc	1 12 7, function_name $L__info_string0, inlined_at 1 30 2
	wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%r1,%r2,%r3,%r4}, %rd1, %rd2, 0, 1, 1, 0, 0;
	wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%r1,%r2,%r3,%r4}, %rd3, %rd4, 1, 1, 1, 0, 0;
	.loc	1 14 3
	mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1,%f2,%f3,%f4}, {%r5,%r6,%r7,%r8}, {%r9,%r10}, {%f1};
	.loc	1 16 3
	fma.rn.f32 	%f5, %f6, %f7, %f5;
	fma.rn.f32 	%f8, %f6, %f7, %f8;
	.loc	1 18 3
	wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%r1}, %rd1, %rd2, 0, 1, 1, 0, 0;
	.file	1 "{src}"
"""
_SRC = """import triton.language as tl


def k(a, b, acc):
    x = 1
    y = 2
    z = 3
    w = 4
    s = 5
    b_s, _ = f(
        1,
        tl.dot(a, b))  # line 12: the dot's own line, not the statement's first
    acc = 0
    acc += tl.dot(a, b)
    u = 0
    b_pv = tl.dot(a, b, input_precision="ieee")
    v = 0
    return tl.dot(a, b)
"""


def test_dot_shapes_reads_each_dot_of_the_ptx(tmp_path):
    """Instructions are charged to the tl.dot on their .loc line: wgmma N values counted, mma.sync
    shapes named, a dot with only FMAs marked fma; a line that is no dot (10) is left out."""
    src = tmp_path / "kernels.py"
    src.write_text(_SRC)
    dots = aot_model.dot_shapes(_PTX.replace("{src}", str(src)))
    assert dots == {"b_s:12": {"wgmma n8": 2}, "acc:14": {"mma m16n8k16 bf16": 1}, "b_pv:16": {"fma": 2},
                    "dot:18": {"wgmma n128": 1}}
    assert aot_model.mma_sync_count(dots) == 1 and aot_model.wgmma_ns(dots["b_s:12"]) == {8: 2}


def test_occupancy_from_registers_threads_and_shared_memory():
    """Blocks per SM: 64K registers allocated per warp in 256s, per SM quarter; 228 KB of shared
    memory with 1 KB reserved per block; 2048 threads."""
    assert aot_model.occupancy(255, 256, 1024, 90) == (1, "regs")  # 256 regs x 8 warps: one block
    assert aot_model.occupancy(128, 256, 1024, 90) == (2, "regs")
    assert aot_model.occupancy(32, 128, 100 * 1024, 90) == (2, "smem")
    assert aot_model.occupancy(16, 1024, 0, 90) == (2, "threads")
    assert aot_model.occupancy(32, 128, 100 * 1024, 80) == (1, "smem")


def test_model_ranks_wide_wgmma_above_narrow_and_stays_under_the_peak():
    """The estimate falls with narrower N and lower occupancy, and never exceeds the measured peak."""
    def tflops(n, blocks=1):
        dots = {"b_s:1": {f"wgmma n{n}": 8}, "b_pv:2": {"wgmma n128": 8}}
        return aot_model.predict("_varlen_attention_fwd_kernel", "bfloat16", "D=128 causal", dots, blocks, 8)["tflops"]
    assert tflops(8) < tflops(32) < tflops(64) < tflops(128) < aot_model.PEAK_TFLOPS
    assert tflops(64, blocks=1) < tflops(64, blocks=2)
    assert aot_model.wgmma_efficiency(256) == 1.0 and aot_model.wgmma_efficiency(8) < 0.25


def test_kernel_discovery_finds_launched_kernels_only():
    """The parser the coverage check relies on sees the launched kernels, not the inlined helpers."""
    kernels = aot.jit_kernels()
    assert {"_varlen_attention_fwd_kernel", "_varlen_attention_bwd_delta_kernel", "_pack_rows_fwd_kernel",
            "_group_filter_contig_fwd_kernel", "_policy_loss_bwd_kernel"} <= set(kernels)
    assert "_fwd_inner" not in kernels and "_cast" not in kernels and "_group_stats" not in kernels
    assert set(aot.MATMUL_KERNELS) <= set(kernels) and set(EXPECTED_DOTS) == set(aot.MATMUL_KERNELS)


def test_every_exception_names_its_reason():
    """One table: every entry has a reason, and the dK/dV m64n32 entry points at issue 31."""
    assert all(e.reason and e.rules for e in aot.EXCEPTIONS)
    narrow = [e for e in aot.EXCEPTIONS if e.kernel == "_varlen_attention_bwd_dkdv_kernel" and "b_st" in e.dots]
    assert any(e.reason.startswith("issue 31: 128 keys x 32 queries at 8 warps gives N=32") for e in narrow)


@pytest.mark.parametrize("arch", aot.ARCHS, ids=[f"sm_{a}" for a in aot.ARCHS])
def test_every_kernel_compiles_fits_and_does_not_spill(arch, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_CACHE_DIR", str(ROOT / ".cache" / "triton-aot"))
    out = tmp_path / "records.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "aot.py"), "--set", "test",
                           "--arch", str(arch), "--json", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=540)
    assert proc.returncode == 0, f"aot.py failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}"
    records = [aot.Record(**r) for r in json.loads(out.read_text())]
    print(f"sm_{arch}: {len(records)} kernels compiled in {sum(r.compile_s for r in records):.0f} s\n"
          + aot.shapes_table(records) + "\n\n" + aot_model.summarize(records))

    missing = {k for k in aot.jit_kernels() if aot.KERNEL_ARCHS.get(k, arch) == arch} - {r.kernel for r in records}
    assert not missing, f"kernels never compiled (add a launch to aot_cases.cases): {sorted(missing)}"
    # The instruction reader found every dot of every 16-bit matmul kernel (else the per-dot rules
    # are void; fp32 instances move dP into _dot_f64 and may fuse CUDA-core products across lines).
    unread = [f"{r.kernel} [{r.config}] {r.dtype} {r.inputs}: {sorted(r.dots)}" for r in records
              if r.kernel in EXPECTED_DOTS and r.dtype in aot.B16
              and not EXPECTED_DOTS[r.kernel] <= {label.split(":")[0] for label in r.dots}]
    assert not unread, "dots not found in the PTX:\n" + "\n".join(unread)
    if arch == 90:
        assert any(aot_model.wgmma_ns(s) for r in records for s in r.dots.values()), "no wgmma read at all"
    assert all(r.blocks >= 1 for r in records), "a kernel that fits no block on an SM"
    broken = [(r, v) for r in records for v in aot.violations(r)]
    unexpected = [f"{r.kernel} [{r.config}] {r.op}: {r.dtype} {r.inputs}: {v}"
                  for r, v in broken if not aot.exception_of(r, v)]
    assert not unexpected, f"sm_{arch}:\n" + "\n".join(unexpected)
    # The documented exceptions still happen (else the entry is stale: delete it), each for the
    # inputs it names that this set compiles.
    seen = {aot.exception_of(r, v) for r, v in broken}
    due = aot.due_exceptions(records, arch)
    stale = [f"{e.kernel} {e.dtypes} rows {e.rows} {e.rules} {e.dots}" for e in due - seen]
    assert not stale, "documented exceptions not observed:\n" + "\n".join(stale)


def test_calibration_fit_is_the_minimax_factor_per_family():
    """calibrate.fit: per instruction family, from the forward anchors only, the factor whose largest
    over- and under-estimate are equal (raw estimates 500 / 400 against published 400 / 400: h = 0.89)."""
    from gpu import calibrate
    rows = [dict(design="tutorial", **{"pass": "forward"}, published=400.0),
            dict(design="tutorial", **{"pass": "forward"}, published=400.0),
            dict(design="tutorial", **{"pass": "backward"}, published=100.0),  # held out: ignored by the fit
            dict(design="fa2", **{"pass": "forward"}, published=300.0)]
    fitted = calibrate.fit(rows, {0: 500.0, 1: 400.0, 2: 900.0, 3: 600.0})
    assert fitted == {"wgmma": round(2 / (1.25 + 1.0), 2), "mma": 0.5}
    errs = [fitted["wgmma"] * raw / 400.0 - 1 for raw in (500.0, 400.0)]
    assert abs(errs[0] + errs[1]) < 0.02


def test_estimates_outside_the_calibrated_range_are_flagged():
    """An estimate of a kernel unlike every anchor (1 pipeline stage, 1 warpgroup per SM, no tensor-core
    dot) names why; one inside the anchors' range names nothing."""
    wide = {"b_s:1": {"wgmma n128": 8}, "b_pv:2": {"wgmma n128": 8}}
    def flag(dots, blocks, warps, config):
        return aot_model.predict("_varlen_attention_fwd_kernel", "bfloat16", "D=128 causal", dots, blocks, warps,
                                 config)["outside_calibration"]
    assert flag(wide, 1, 8, "stages=3") == ""
    assert flag(wide, 1, 8, "stages=1") == "1 stage(s)"
    assert flag(wide, 1, 4, "stages=2") == "1 warpgroup(s)/SM"
    assert "no tensor-core dot" in flag({"b_s:1": {"fma": 64}}, 2, 4, "stages=2")
