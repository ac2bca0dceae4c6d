"""How npu_ops is wired in: a privateuseone kernel on every dapo custom op, loaded through the
entry point on the first privateuseone tensor, the torch-path kernels, the model's NPU ops off the
NPU, and the lazy torch_npu import (missing / broken)."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import dapo_kernels as dk  # noqa: F401  (defines the custom ops)
import npu_ops
from dapo_kernels import _registry
from dapo_kernels.ops.moe.permutation import build_permutation
from dapo_trainer import npu_model_ops as model_ops
from npu_ops import _lazy, generic
from npu_ops import varlen_attention as attention


def test_every_dapo_custom_op_has_a_privateuseone_kernel():
    dapo_ops = {name for name in torch._C._dispatch_get_all_op_names() if name.startswith("dapo::")}
    assert dapo_ops == set(npu_ops.kernels()), "a dapo custom op without an NPU kernel, or a stale entry"
    assert all(npu_ops.registered().values())


def test_torch_path_kernels_ignore_a_forced_triton_backend(monkeypatch):
    """On NPU the generic ops must run their torch code even under DAPO_KERNELS_BACKEND=triton."""
    for name in generic.TORCH_PATH_OPS:
        def refuse(*args, _name=name):
            raise AssertionError(f"{_name}: the Triton kernel ran on the NPU path")
        monkeypatch.setitem(_registry._impls[name], "triton", refuse)
    x = torch.randn(6, 3)
    idx = torch.tensor([4, 0, 2])
    lp, old, adv = torch.randn(3, 5).unbind(0)
    mask = torch.tensor([True, False, True, True, True])
    w = torch.full((1,), 0.25, dtype=torch.float64)
    cases = {
        "index_rows": (x, idx),
        "scatter_rows": (x[:3], idx, 6),
        "packed_position_ids": (torch.tensor([0, 2, 5], dtype=torch.int32), 5),
        "overlong_penalty": (torch.tensor([3, 9, 12]), 8.0, 4.0, 1.0),
        "policy_loss_sums": (lp, old, adv, mask, w, 0.2, 0.28, 3.0, torch.rand(5) + 0.5),  # + rollout IS weights
        "policy_loss_grad": (torch.ones((), dtype=torch.float64), lp, old, adv, mask, w, 0.2, 0.28, 3.0),
    }
    perm = build_permutation(torch.tensor([[1, 0], [1, 2], [0, 1]]), 3)  # 3 tokens, top-2 of 3 experts
    xs, gate_up, down, tw = torch.randn(3, 4), torch.randn(3, 6, 4), torch.randn(3, 4, 3), torch.rand(3, 2)
    cases["moe_experts_fwd"] = (xs, gate_up, down, tw, *perm)
    with dk.use_backend("torch"):
        gu = torch.ops.dapo.moe_experts_fwd(*cases["moe_experts_fwd"])[1]
    cases["moe_experts_bwd"] = (torch.randn(3, 4), xs, gate_up, down, tw, gu, *perm)
    kernels = npu_ops.kernels()
    with dk.use_backend("triton"):
        got = {name: kernels[f"dapo::{name}"](*args) for name, args in cases.items()}
    with dk.use_backend("torch"):
        for name, args in cases.items():
            torch.testing.assert_close(got[name], getattr(torch.ops.dapo, name)(*args), rtol=0, atol=0)


def test_model_ops_leave_cpu_tensors_to_the_model():
    x = torch.randn(4, 2, 8)
    assert model_ops.rms_norm(x, torch.ones(8), 1e-6) is None
    assert model_ops.rotary(x, torch.ones(4, 8), torch.zeros(4, 8)) is None
    assert model_ops.swiglu(x, x) is None


def _call_npu_kernel():
    q = torch.randn(3, 2, 16)
    attention.varlen_attention_fwd(q, q, q, torch.tensor([0, 3], dtype=torch.int32), 3, True, 0.25)


def test_missing_torch_npu_raises_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # "import torch_npu" raises ImportError
    _lazy.reset()
    with pytest.raises(RuntimeError) as exc:
        _call_npu_kernel()
    msg = str(exc.value)
    assert "\n" not in msg and "torch_npu" in msg and "ModuleNotFoundError" in msg and "CPU and CUDA" in msg
    _lazy.reset()


def test_broken_torch_npu_raises_one_line_and_is_tried_once(monkeypatch, tmp_path):
    """torch_npu without the CANN libraries fails inside its import (here with OSError)."""
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    attempts = tmp_path / "attempts"
    (pkg / "__init__.py").write_text(
        f"open({str(attempts)!r}, 'a').write('x')\n"
        "raise OSError('libascendcl.so: cannot open shared object file: No such file or directory')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    _lazy.reset()
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"OSError: libascendcl\.so") as exc:
            _call_npu_kernel()
        assert "\n" not in str(exc.value)
    assert attempts.read_text() == "x"
    assert "torch_npu" not in sys.modules
    # CPU ops are untouched by the failed import.
    q = torch.randn(3, 2, 16)
    assert dk.varlen_attention(q, q, q, torch.tensor([0, 3], dtype=torch.int32), 3).shape == q.shape
    _lazy.reset()


def test_trainer_device_helpers(monkeypatch):
    from dapo_trainer.parallel.dist import backend_for_device, init_distributed, visible_devices_env

    assert visible_devices_env("npu:1") == "ASCEND_RT_VISIBLE_DEVICES"
    assert visible_devices_env("cuda") == "CUDA_VISIBLE_DEVICES"
    assert backend_for_device("privateuseone") == "hccl"
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    _lazy.reset()
    with pytest.raises(RuntimeError, match="need torch_npu"):
        init_distributed("npu")
    _lazy.reset()


LAZY_LOAD = textwrap.dedent(r'''
    import sys
    import torch
    import dapo_kernels as dk
    from dapo_kernels import _registry
    assert "npu_ops" not in sys.modules, "import dapo_kernels imported npu_ops"
    # A privateuseone device backed by Python hooks: real tensors of that device (no storage, no
    # aten kernels), so the dispatcher routes dapo ops to their privateuseone kernels as on an NPU.
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend
    _setup_privateuseone_for_python_backend()
    sys.modules["torch_npu"] = None  # the NPU kernel, once reached, says so in its own words
    q = torch._C._acc.create_empty_tensor((3, 2, 16), torch.float32)
    assert q.device.type == "privateuseone", q.device
    try:
        torch.ops.dapo.varlen_attention_fwd(q, q, q, torch.tensor([0, 3], dtype=torch.int32), 3, True, 0.25)
    except RuntimeError as exc:
        assert "NPU ops need torch_npu" in str(exc), exc
    else:
        raise AssertionError("the privateuseone call did not reach npu_ops' kernel")
    assert "npu_ops" in sys.modules and dk.load_backends() == ["npu"]
    assert all(sys.modules["npu_ops"].registered().values())

    # An op that no backend serves: one clear error naming it (no recursion through the loader).
    @torch.library.custom_op("dapo::backend_loader_probe", mutates_args=())
    def probe(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    _registry.install_backend_loaders()
    try:
        torch.ops.dapo.backend_loader_probe(q)
    except NotImplementedError as exc:
        assert "dapo::backend_loader_probe" in str(exc) and "npu" in str(exc), exc
    else:
        raise AssertionError("no error for an op without a privateuseone kernel")
    print("OK")
''')


def test_first_privateuseone_tensor_loads_npu_ops_through_its_entry_point():
    from torch.utils import backend_registration

    if not hasattr(backend_registration, "_setup_privateuseone_for_python_backend"):
        pytest.skip("this torch has no Python privateuseone backend hooks to make privateuseone tensors with")
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, "-c", LAZY_LOAD], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr
