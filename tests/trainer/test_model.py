"""dapo_trainer.model + hf_io: parity with transformers, checkpoint round trips, bad input.

Tiny random models (hidden 64, 2 layers, vocab 128) are built with transformers and
saved with ``save_pretrained`` into tmp dirs - nothing is downloaded.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

import dapo_kernels as dk
from dapo_trainer import ModelConfig, Transformer, config_from_hf, load_hf_model, read_hf_config, save_hf_model
from tests.helpers import cu_seqlens_from
from tests.tolerance import rel_err

transformers = pytest.importorskip("transformers", reason="parity tests need transformers (requirements-dev.txt)")

# float32 parity bound set by the issue: max |ours - theirs| / max |theirs|.
PARITY_RTOL = 1e-5
VOCAB = 128
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               # Small original context so that head_dim 16 has wavelengths in all three bands.
               "original_max_position_embeddings": 16}

VARIANTS = {
    # name: (model class name, config kwargs)
    "llama-gqa": ("Llama", dict(num_attention_heads=4, num_key_value_heads=2)),
    "llama3-rope-bias": ("Llama", dict(num_attention_heads=4, num_key_value_heads=1, rope_theta=500000.0,
                                        rope_scaling=LLAMA3_ROPE, attention_bias=True, mlp_bias=True)),
    "qwen2-hd32": ("Qwen2", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
    "qwen2-tied": ("Qwen2", dict(num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)),
}


def make_hf_model(family: str, kw: dict):
    """A random transformers ``{family}ForCausalLM`` (``Gemma3Text``: Gemma3ForCausalLM) of config ``kw``."""
    cfg_cls = getattr(transformers, f"{family}Config")
    model_cls = getattr(transformers, f"{family.removesuffix('Text')}ForCausalLM")
    cfg = cfg_cls(**{**dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            max_position_embeddings=256, attn_implementation="eager"), **kw})
    model = model_cls(cfg).eval()
    with torch.no_grad():
        # HF init leaves biases at 0 and norms at 1; randomise them so loading them matters.
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="module", params=list(VARIANTS))
def hf_checkpoint(request, tmp_path_factory):
    """(variant, transformers model, checkpoint dir written by save_pretrained)."""
    path = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(*VARIANTS[request.param])
    hf.save_pretrained(str(path))
    return request.param, hf, str(path)


def random_batch(lengths):
    """Right-padded ids [B, S] + mask, and the same tokens packed: ids [T], cu_seqlens, max."""
    S = max(lengths)
    ids = torch.randint(0, VOCAB, (len(lengths), S))
    mask = torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]
    return ids, mask, ids[mask], cu_seqlens_from(lengths), S


def hf_logits(hf, ids, mask):
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=mask.long()).logits[mask]


def ours_logits(model, packed, cu, S):
    with torch.no_grad():
        return model.logits(model(packed, cu, S))


def test_logits_match_transformers_and_survive_save(hf_checkpoint, tmp_path):
    check_logits_and_save(*hf_checkpoint, tmp_path)


def check_logits_and_save(variant, hf, path, tmp_path):
    """load_hf_model's logits on packed sequences are transformers' within PARITY_RTOL, and so are those of
    the sharded checkpoint save_hf_model writes, reloaded by transformers and by load_hf_model."""
    ids, mask, packed, cu, S = random_batch([7, 1, 19, 12])
    ref = hf_logits(hf, ids, mask)
    model = load_hf_model(path)
    err = rel_err(ours_logits(model, packed, cu, S), ref)
    print(f"{variant}: load_hf_model logits max rel err vs transformers {err:.2e}")
    assert err < PARITY_RTOL

    # Small shards force the index layout; transformers must read what we write.
    out = tmp_path / "saved"
    save_hf_model(model, str(out), max_shard_size=64 * 1024)
    assert (out / "model.safetensors.index.json").exists()
    reloaded_hf = type(hf).from_pretrained(str(out), attn_implementation="eager").eval()
    err_saved = rel_err(hf_logits(reloaded_hf, ids, mask), ref)
    print(f"{variant}: after save_hf_model -> from_pretrained max rel err {err_saved:.2e}")
    assert err_saved < PARITY_RTOL
    err_ours = rel_err(ours_logits(load_hf_model(str(out)), packed, cu, S), ref)
    assert err_ours < PARITY_RTOL


def _param_grads(model, batch, probe):
    """{parameter name: grad} of sum(logits * probe) for a transformers model on the padded batch."""
    ids, mask = batch[:2]
    model.zero_grad()
    (model(input_ids=ids, attention_mask=mask.long()).logits[mask] * probe.to(model.dtype)).sum().backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _worst_grad_err(grads, ref64) -> float:
    """max over parameters of max |grad - ref| / max |ref|."""
    return max(rel_err(grads[n], r) for n, r in ref64.items())


# Independent batches whose errors are summed: the worst parameter-gradient error is a single
# heavy-tailed sample - it is usually a k_proj bias, whose gradient mostly cancels (softmax ignores
# a bias shared by all keys; only RoPE breaks that) - so one batch's ratio to transformers' error
# spreads over 0.4x-2x between equally exact implementations; the sum over three spreads less.
GRAD_BATCHES = 3


def test_gradients_match_transformers(hf_checkpoint):
    check_gradients(*hf_checkpoint)


def check_gradients(variant, hf, path, lengths=(9, 14, 3)):
    """Parameter gradients against transformers run in float64: our float32 error is at most 2x
    transformers' own float32 error (its eager or sdpa attention, the larger), summed over batches."""
    model = load_hf_model(path)
    theirs = {n for n, _ in hf.named_parameters()}
    key = {}  # our parameter name -> transformers'
    for n, _ in model.named_parameters():
        k = n if n.startswith("lm_head") else "model." + n
        key[n] = k if k in theirs else "model.embed_tokens.weight"  # tied: listed once, as the embedding
    # Eager experts too (MoE families): torch's grouped_mm, transformers' default, has no float64.
    hf64 = type(hf).from_pretrained(path, attn_implementation="eager", experts_implementation="eager",
                                    dtype=torch.float64).eval()
    hf_sdpa = type(hf).from_pretrained(path, attn_implementation="sdpa").eval()
    assert next(hf64.parameters()).dtype == torch.float64
    ours_err = theirs_err = parity = 0.0
    for _ in range(GRAD_BATCHES):
        batch = random_batch(list(lengths))
        probe = torch.randn(int(batch[1].sum()), VOCAB)
        ref64, eager, sdpa = (_param_grads(m, batch, probe) for m in (hf64, hf, hf_sdpa))
        model.zero_grad()
        (model.logits(model(*batch[2:])) * probe).sum().backward()
        ours = {key[n]: p.grad for n, p in model.named_parameters()}
        ref64 = {k: ref64[k] for k in ours}
        ours_err += _worst_grad_err(ours, ref64)
        theirs_err += max(_worst_grad_err(eager, ref64), _worst_grad_err(sdpa, ref64))
        parity = max(parity, _worst_grad_err(ours, eager))
    print(f"{variant}: parameter-gradient max rel err vs float64, summed over {GRAD_BATCHES} batches: "
          f"ours {ours_err:.2e}, transformers fp32 {theirs_err:.2e}; ours vs transformers fp32 {parity:.2e}")
    assert ours_err <= 2 * theirs_err


def test_config_dialects_agree(hf_checkpoint):
    """transformers 5 writes rope_parameters; released checkpoints use rope_theta + rope_scaling."""
    _, _, path = hf_checkpoint
    with open(os.path.join(path, "config.json")) as f:
        v5 = json.load(f)
    assert "rope_parameters" in v5, "transformers wrote the classic dialect; this test needs the v5 one"
    classic = {k: v for k, v in v5.items() if k != "rope_parameters"}
    rope = dict(v5["rope_parameters"])
    classic["rope_theta"] = rope.pop("rope_theta")
    # Old releases spell the key "type".
    classic["rope_scaling"] = None if rope["rope_type"] == "default" else {"type": rope.pop("rope_type"), **rope}
    assert config_from_hf(classic) == config_from_hf(v5) == read_hf_config(path)


def test_single_file_save_roundtrip(tmp_path):
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, qkv_bias=True, model_type="qwen2")
    model = Transformer(cfg).init_weights(0.1)
    save_hf_model(model, str(tmp_path))
    assert (tmp_path / "model.safetensors").exists() and not (tmp_path / "model.safetensors.index.json").exists()
    loaded = load_hf_model(str(tmp_path))
    assert loaded.config == cfg
    for (n, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), n


def tiny_model(**kw) -> Transformer:
    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
               num_kv_heads=2, head_dim=16)
    cfg.update(kw)
    return Transformer(ModelConfig(**cfg)).init_weights(0.1)


def test_forward_padded_equals_packed():
    model = tiny_model()
    ids, mask, packed, cu, S = random_batch([4, 11, 1])
    with torch.no_grad():
        padded = model.forward_padded(ids, mask)
        ref = model(packed, cu, S)
    assert torch.equal(padded[mask], ref)
    assert not padded[~mask].any()


def test_activation_checkpointing_gives_same_grads():
    model = tiny_model()
    _, _, packed, cu, S = random_batch([6, 13])
    probe = torch.randn(packed.shape[0], VOCAB)
    grads = []
    for ckpt in (False, True):
        model.zero_grad()
        model.activation_checkpointing = ckpt
        (model.logits(model(packed, cu, S)) * probe).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_position_ids_default_restarts_per_sequence():
    model = tiny_model()
    _, _, packed, cu, S = random_batch([5, 8])
    with torch.no_grad():
        default = model(packed, cu, S)
        explicit = model(packed, cu, S, position_ids=dk.packed_position_ids(cu, packed.shape[0]))
        shifted = model(packed, cu, S, position_ids=dk.packed_position_ids(cu, packed.shape[0]) + 3)
    assert torch.equal(default, explicit)
    assert not torch.allclose(default, shifted)


# --------------------------------------------------------------------------- bad input
def _rewrite_config(path, **changes):
    file = os.path.join(path, "config.json")
    with open(file) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(file, "w") as f:
        json.dump(cfg, f)


@pytest.fixture
def saved_tiny(tmp_path):
    save_hf_model(tiny_model(), str(tmp_path))
    return str(tmp_path)


@pytest.mark.parametrize("changes, message", [
    (dict(model_type="gpt2", architectures=["GPT2LMHeadModel"]), "model_type 'gpt2'"),
    (dict(architectures=["LlamaForSequenceClassification"]), "LlamaForSequenceClassification"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope type 'yarn'"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "low_freq_factor"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(num_attention_heads=None), "num_attention_heads"),
], ids=["arch", "head", "yarn", "llama3-fields", "act", "heads-missing"])
def test_unsupported_config_is_named(saved_tiny, changes, message):
    _rewrite_config(saved_tiny, **changes)
    with pytest.raises(ValueError, match=message):
        load_hf_model(saved_tiny)


def test_missing_weight_is_named(saved_tiny):
    from safetensors.torch import load_file, save_file

    file = os.path.join(saved_tiny, "model.safetensors")
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.up_proj.weight"], tensors["lm_head.weight"]
    save_file(tensors, file)
    with pytest.raises(ValueError, match=r"missing 2 weight") as err:
        load_hf_model(saved_tiny)
    assert "'lm_head.weight'" in str(err.value) and "'model.layers.1.mlp.up_proj.weight'" in str(err.value)


def test_wrong_weight_shape_is_named(saved_tiny):
    _rewrite_config(saved_tiny, intermediate_size=80)
    with pytest.raises(ValueError, match=r"mlp\.(gate|up|down)_proj\.weight has shape \[\d+, \d+\], config\.json implies .*80"):
        load_hf_model(saved_tiny)


def test_no_checkpoint_files(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        load_hf_model(str(tmp_path))
    save_hf_model(tiny_model(), str(tmp_path))
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="model.safetensors"):
        load_hf_model(str(tmp_path))


@pytest.mark.parametrize("case", ["last-too-small", "last-too-large", "decreasing", "float-ids", "2d-ids"])
def test_bad_forward_input(case):
    model = tiny_model()
    ids = torch.randint(0, VOCAB, (10,))
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    args, match = {
        "last-too-small": ((ids, torch.tensor([0, 4, 9], dtype=torch.int32), 6), r"cu_seqlens\[-1\].*10"),
        "last-too-large": ((ids, torch.tensor([0, 4, 12], dtype=torch.int32), 8), r"cu_seqlens\[-1\].*10"),
        "decreasing": ((ids, torch.tensor([0, 6, 4, 10], dtype=torch.int32), 6), "non-decreasing"),
        "float-ids": ((ids.float(), cu, 6), "input_ids must have dtype"),
        "2d-ids": ((ids.view(2, 5), cu, 6), "input_ids must be 1-D"),
    }[case]
    with pytest.raises(ValueError, match=match):
        model(*args)


@pytest.mark.parametrize("temperature", [1.0, 0.6], ids=["T1", "T0.6"])
def test_log_probs_fused_equals_log_softmax_of_logits(temperature):
    model = tiny_model(tie_word_embeddings=True)
    _, _, packed, cu, S = random_batch([8, 3, 15])
    labels = torch.randint(0, VOCAB, packed.shape)
    with torch.no_grad():
        hidden = model(packed, cu, S)
        log_prob, entropy = model.log_probs(hidden, labels, temperature=temperature, return_entropy=True)
        ref = torch.log_softmax(model.logits(hidden).double() / temperature, dim=-1)
    assert rel_err(log_prob, ref.gather(1, labels[:, None]).squeeze(1)) < PARITY_RTOL
    assert rel_err(entropy, -(ref.exp() * ref).sum(-1)) < PARITY_RTOL
