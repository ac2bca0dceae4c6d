"""dapo_kernels.flash_attn_compat: flash-attn's names, signature, defaults and
return conventions on dk.varlen_attention / the packing ops, and clear errors for what is missing."""
import inspect

import pytest
import torch

import dapo_kernels as dk
from dapo_kernels.flash_attn_compat import flash_attn_varlen_func
from dapo_kernels.flash_attn_compat.bert_padding import index_first_axis, index_put_first_axis, pad_input, unpad_input
from tests.helpers import backend, cu_seqlens_from

# flash-attn 2.6+'s documented signature (flash_attn_interface.flash_attn_varlen_func).
FLASH_ATTN_PARAMS = [
    ("q", inspect.Parameter.empty), ("k", inspect.Parameter.empty), ("v", inspect.Parameter.empty),
    ("cu_seqlens_q", inspect.Parameter.empty), ("cu_seqlens_k", inspect.Parameter.empty),
    ("max_seqlen_q", inspect.Parameter.empty), ("max_seqlen_k", inspect.Parameter.empty),
    ("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0),
    ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False), ("block_table", None),
]


def test_signature_is_flash_attns():
    params = inspect.signature(flash_attn_varlen_func).parameters
    assert [(n, p.default) for n, p in params.items()] == FLASH_ATTN_PARAMS
    try:
        from flash_attn import flash_attn_varlen_func as real
    except ImportError:
        print("flash_attn not installed: compared with its documented signature only")
        return
    real_params = inspect.signature(real).parameters
    assert [(n, p.default) for n, p in params.items() if n in real_params] == \
        [(n, p.default) for n, p in real_params.items() if n in params]


def _qkv(lengths=(7, 0, 12, 1), D=16, Hq=4, Hkv=2, dtype=torch.float32):
    cu = cu_seqlens_from(lengths)
    T = int(cu[-1])
    return [torch.randn(T, h, D, dtype=dtype, requires_grad=True) for h in (Hq, Hkv, Hkv)] + [cu]


@pytest.mark.parametrize("be", ["torch", "triton"])
def test_defaults_and_returns(be):
    q, k, v, cu = _qkv()
    with backend(be):
        out = flash_attn_varlen_func(q, k, v, cu, cu, 12, 12)
        # flash-attn's default is non-causal, dk.varlen_attention's causal.
        torch.testing.assert_close(out, dk.varlen_attention(q, k, v, cu, 12, causal=False), rtol=0, atol=0)
        assert not torch.allclose(out, dk.varlen_attention(q, k, v, cu, 12))
        got = flash_attn_varlen_func(q, k, v, cu, cu, 12, 12, causal=True, return_attn_probs=True, softmax_scale=0.3,
                                     window_size=(3, -1), softcap=2.0, deterministic=True)
        want = dk.varlen_attention(q, k, v, cu, 12, softmax_scale=0.3, return_lse=True, window_size=(3, -1),
                                   softcap=2.0)
    assert isinstance(got, tuple) and len(got) == 3 and got[2] is None
    for a, b in zip(got[:2], want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert got[1].shape == (4, q.shape[0]) and got[1].dtype == torch.float32
    got[0].sum().backward()
    assert q.grad is not None and k.grad is not None


def test_cu_seqlens_k_equal_values_accepted_different_rejected_on_device():
    q, k, v, cu = _qkv()
    torch.testing.assert_close(flash_attn_varlen_func(q, k, v, cu, cu.clone(), 12, 12),
                               flash_attn_varlen_func(q, k, v, cu, cu, 12, 12), rtol=0, atol=0)
    other = cu_seqlens_from([7, 1, 11, 1])
    with pytest.raises(RuntimeError, match="cu_seqlens_k must equal cu_seqlens_q"):
        flash_attn_varlen_func(q, k, v, cu, other, 12, 12)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(dropout_p=0.1), NotImplementedError, "dropout_p > 0"),
    (dict(dropout_p=1.5), ValueError, "dropout_p must be in"),
    (dict(alibi_slopes=torch.ones(4)), NotImplementedError, "alibi_slopes"),
    (dict(block_table=torch.zeros(2, 1, dtype=torch.int32)), NotImplementedError, "block_table"),
    (dict(deterministic=1), TypeError, "deterministic must be a bool"),
    (dict(window_size=(-3, 0)), ValueError, r"window_size\[0\]"),
    (dict(softcap=-1.0), ValueError, "softcap"),
])
def test_unsupported_and_bad_arguments(kw, exc, match):
    q, k, v, cu = _qkv()
    with pytest.raises(exc, match=match):
        flash_attn_varlen_func(q, k, v, cu, cu, 12, 12, **kw)


def test_cross_attention_rejected():
    q, k, v, cu = _qkv()
    cu_k = cu_seqlens_from([8, 0, 12, 1])
    with pytest.raises(NotImplementedError, match="cross-attention"):
        flash_attn_varlen_func(q, k[:-1].detach().clone(), v, cu, cu_k, 12, 12)


@pytest.mark.parametrize("be", ["torch", "triton"])
def test_bert_padding_names(be):
    x = torch.randn(3, 6, 5, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0], [1, 0, 1, 1, 1, 1]])
    with backend(be):
        x_unpad, indices, cu, max_len, seqused = unpad_input(x, mask)  # flash-attn >= 2.7: a 5-tuple
        assert torch.equal(indices, mask.reshape(-1).nonzero()[:, 0]) and max_len == 5
        assert cu.tolist() == [0, 3, 3, 8] and seqused.tolist() == [3, 0, 5]
        flat = x.reshape(18, 5)
        gathered = index_first_axis(flat, indices)
        assert torch.equal(gathered, flat.detach()[indices])
        back = pad_input(x_unpad, indices, 3, 6)
        assert torch.equal(back, x.detach() * mask[..., None])
        put = index_put_first_axis(gathered, indices, 18)
        assert torch.equal(put, back.reshape(18, 5))
        (g,) = torch.autograd.grad(put.square().sum(), x)
    assert torch.equal(g, 2 * x.detach() * mask[..., None])
    with pytest.raises(ValueError, match="indices must lie in"):
        index_first_axis(flat, torch.tensor([0, 18]))
