"""End to end through the dispatcher, in a fresh process.

1. ``import dapo_kernels`` / ``dapo_trainer.model`` imports no npu_ops and never tries to import
   torch_npu (a torch_npu on the path that would leave a marker and raise is never touched);
   npu_ops is then found through its ``dapo_kernels.backends`` entry point.
2. The public ``dk.*`` calls (forward and backward) give the same results when every
   dapo custom op is routed to its npu_ops kernel: there is no NPU here, so the kernels
   are registered on the CPU key instead of privateuseone, with the fake torch_npu.
   This checks the kernels' signatures, return types and autograd plumbing against the
   real custom-op schemas, which the direct kernel tests cannot.
3. The same under ``use_backend("triton")`` (``DAPO_KERNELS_BACKEND=triton``): the NPU kernels
   still run, and the public functions read their results as theirs (varlen attention's lse
   is natural log, not Triton's base 2).
"""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(r'''
    import os, sys
    import torch
    marker = sys.argv[1]
    import dapo_kernels as dk
    import dapo_trainer.model  # noqa: F401
    assert "npu_ops" not in sys.modules, "import dapo_kernels / dapo_trainer.model imported npu_ops"
    # npu_ops is found through its entry point (group dapo_kernels.backends), as on first NPU use.
    assert dk.load_backends() == ["npu"], dk.load_backends()
    npu_ops = sys.modules["npu_ops"]
    assert all(npu_ops.registered().values())
    assert "torch_npu" not in sys.modules and not os.path.exists(marker), "an import tried torch_npu"

    def leaf(*shape, dtype=torch.float32):
        return torch.randn(*shape, dtype=dtype).requires_grad_()

    def run():
        torch.manual_seed(0)
        r = {}
        cu = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
        q, k, v = leaf(12, 4, 16), leaf(12, 2, 16), leaf(12, 2, 16)
        o, r["lse"] = dk.varlen_attention(q, k, v, cu, 7, return_lse=True)
        o2 = dk.varlen_attention(q, k, v, cu, 7, causal=False, softmax_scale=0.3)
        (o * torch.randn_like(o)).sum().add((o2 * torch.randn_like(o2)).sum()).backward()
        r.update(attn=o, attn_nc=o2, dq=q.grad, dk=k.grad, dv=v.grad)

        h, w = leaf(9, 8), leaf(20, 8)
        lab = torch.randint(0, 20, (9,))
        lp, ent = dk.linear_log_probs(h, w, lab, temperature=0.8, return_entropy=True)
        (lp.sum() + 0.3 * ent.sum()).backward()
        r.update(lp=lp, ent=ent, llp_dh=h.grad, llp_dw=w.grad)

        h, w = leaf(9, 8), leaf(20, 8)
        old, adv = -torch.rand(9), torch.randn(9)
        mask = torch.rand(9) > 0.3
        loss, m = dk.fused_linear_policy_loss(h, w, lab, old, adv, mask, entropy_coeff=0.01,
                                              ref_log_prob=-torch.rand(9), kl_coef=0.1,
                                              rollout_is_weights=torch.rand(9) + 0.5)
        loss.backward()
        r.update(fused=loss, fused_clip=m["pg_clipfrac"], fused_dh=h.grad, fused_dw=w.grad)

        lp2 = leaf(3, 6)
        pl, pm = dk.policy_loss(lp2, -torch.rand(3, 6), torch.randn(3, 6), torch.rand(3, 6) > 0.2,
                                loss_agg_mode="seq-mean-token-mean", rollout_is_weights=torch.rand(3, 6) + 0.5)
        pl.backward()
        r.update(pl=pl, pl_kl=pm["ppo_kl"], pl_grad=lp2.grad)

        x = leaf(3, 5, 4)
        am = torch.tensor([[1, 1, 0, 0, 0], [0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
        xu, idx, cu2, _, _ = dk.unpad_input(x, am)
        xp = dk.pad_input(xu * 2, idx, 3, 5)
        xp.sum().backward()
        r.update(unpad=xu, pad=xp, cu2=cu2, pad_grad=x.grad, pos=dk.packed_position_ids(cu2, xu.shape[0]))

        gf = dk.group_filter(torch.tensor([1., 0, 1, 1, 1, 1, 0, 0]), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]), 4)
        r.update({f"gf_{k_}": v_ for k_, v_ in gf._asdict().items()})
        r["overlong"] = dk.overlong_penalty(torch.tensor([10, 90, 100]), 100, 20)
        return r

    base = run()
    sys.path.insert(0, os.getcwd())
    from tests.npu_fake import fake_torch_npu
    sys.modules["torch_npu"] = fake_torch_npu.module()
    npu_ops._lazy.reset()
    npu_ops.register("cpu")
    got = run()
    for key in base:
        torch.testing.assert_close(got[key], base[key], rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")
    calls = fake_torch_npu.calls
    assert len(calls["npu_fusion_attention"]) == 2 and len(calls["npu_fusion_attention_grad"]) == 2, dict(calls)
    assert calls["npu_fusion_attention"][0]["scale"] == 0.25 and calls["npu_fusion_attention"][0]["lens"] == [5, 12]
    with dk.use_backend("triton"):
        forced = run()
    for key in base:
        torch.testing.assert_close(forced[key], base[key], rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{key} (triton forced): {m}")
    assert len(calls["npu_fusion_attention"]) == 4, "the NPU kernel must serve the forced-triton call too"
    print("OK", len(base), "results")
''')


def test_public_ops_route_through_npu_kernels(tmp_path):
    poisoned = tmp_path / "torch_npu"
    poisoned.mkdir()
    marker = tmp_path / "imported"
    (poisoned / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\nraise ImportError('no CANN')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(marker)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr
