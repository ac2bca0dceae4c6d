"""The integrations reject bad arguments naming them (apply_dapo_kernels'
model and per-token tensors, integrations.verl.apply() without ray) and flash_attn_compat takes a
tensor window_size, as flash-attn's own tests pass one."""
import sys

import pytest
import torch

from dapo_kernels import flash_attn_compat
from dapo_kernels.flash_attn_compat import flash_attn_varlen_func
from dapo_kernels.integrations import verl as dkv
from tests.helpers import cu_seqlens_from


# --------------------------------------------------------------------------- item 15
def test_window_size_tensor_is_read_once_on_the_host():
    """window_size as a 2-element integer tensor (flash-attn's test: torch.randint) gives what the
    same tuple gives; other tensors are a ValueError naming window_size; the docstring says so."""
    cu = cu_seqlens_from([7, 0, 12, 1])
    q, k, v = (torch.randn(20, h, 16) for h in (4, 2, 2))
    want = flash_attn_varlen_func(q, k, v, cu, cu, 12, 12, causal=True, window_size=(3, 0))
    got = flash_attn_varlen_func(q, k, v, cu, cu, 12, 12, causal=True, window_size=torch.tensor([3, 0]))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for bad in (torch.tensor([3.0, 0.0]), torch.tensor([1, 2, 3]), torch.tensor(3)):
        with pytest.raises(ValueError, match="window_size"):
            flash_attn_varlen_func(q, k, v, cu, cu, 12, 12, window_size=bad)
    assert "window_size`` may be a tensor" in flash_attn_compat.__doc__


# --------------------------------------------------------------------------- item 13: verl without ray
def test_verl_apply_without_ray_says_what_to_install(tmp_path, monkeypatch):
    """verl importable but ray not: apply() raises an ImportError naming ray and the install command."""
    pkg = tmp_path / "verl"
    for sub in ("", "trainer", "trainer/ppo", "utils"):
        (pkg / sub).mkdir(exist_ok=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "trainer" / "ppo" / "core_algos.py").write_text("import ray  # noqa\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "verl" or m.startswith("verl.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ModuleNotFoundError
    try:
        with pytest.raises(ImportError, match=r"needs ray.*pip install ray") as e:
            dkv.apply()
        assert e.value.name == "ray"
    finally:
        for name in [m for m in sys.modules if m == "verl" or m.startswith("verl.")]:
            del sys.modules[name]
    assert not dkv._REGISTRY_ORIGINALS  # nothing was patched


def test_verl_apply_without_verl(monkeypatch):
    """No verl at all: an ImportError naming verl."""
    for name in [m for m in sys.modules if m == "verl" or m.startswith("verl.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "verl", None)
    with pytest.raises(ImportError, match=r"needs verl .*pip install verl"):
        dkv.apply()


# --------------------------------------------------------------------------- item 13: apply_dapo_kernels
transformers = pytest.importorskip("transformers", reason="transformers is not installed (requirements-dev.txt)")


def _model():
    from dapo_kernels.integrations import transformers as dkt

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    return dkt, dkt.apply_dapo_kernels(transformers.AutoModelForCausalLM.from_config(cfg))


@pytest.mark.parametrize("bad", [object(), "gpt2", torch.nn.Linear(2, 2)])
def test_apply_dapo_kernels_rejects_a_non_model(bad):
    """Anything but a transformers causal LM is a TypeError naming the model argument."""
    from dapo_kernels.integrations.transformers import apply_dapo_kernels

    with pytest.raises(TypeError, match=r"apply_dapo_kernels: model must be a transformers causal LM"):
        apply_dapo_kernels(bad)


@pytest.mark.parametrize("name", ["advantages", "old_log_prob", "response_mask", "ref_log_prob"])
def test_apply_dapo_kernels_per_token_tensors_of_the_wrong_shape(name):
    """A per-token tensor that is not [B, S] like the labels is a ValueError naming it and both shapes."""
    _, model = _model()
    ids = torch.randint(0, 32, (2, 6))
    kw = dict(advantages=torch.ones(2, 6))
    kw[name] = torch.ones(2, 5) if name != "response_mask" else torch.ones(2, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match=rf"{name} must have shape \[2, 6\] \(the labels'\), got \[2, 5\]"):
        model(input_ids=ids, labels=ids, **kw)
