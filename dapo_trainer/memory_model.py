"""Per-device memory of a DAPO step with this trainer: what ``dapo-tune`` plans with and what bounds
adaptive sampling's generation batch (:func:`dapo_trainer.adaptive_sampling.gen_size_ceiling`).

:func:`train_memory` counts, for one rank of the update (bytes):

* ``params``, ``grads``: the parameters and their gradients in the training dtype, divided over
  TP ranks (but the sparse MLPs, which TP keeps whole: ``ModelConfig.moe_params``) and, under FSDP,
  over the FSDP ranks; a mixture-of-experts layer counts its router
  (E x H) and all E experts (E x 3 H moe_I: ``ModelConfig.layer_params``), whichever tokens they see;
* ``optimizer``: AdamW's two moments in the parameter dtype (torch keeps them so);
* ``optimizer_step``: the AdamW step's temporaries: one parameter-sized tensor list with the
  foreach implementation (torch's default on CUDA), one tensor's worth with the per-tensor loop
  (its default on the CPU; an MoE layer's largest is its experts' stacked gate / up, 2 E moe_I H);
* ``activations``: what autograd keeps for a micro-batch of ``tokens`` tokens. Per layer and token,
  the layer input, the two RMSNorms' normalised values and outputs, the attention residual
  (6 H), q and k after RoPE (RoPE's products by cos / sin keep only cos / sin), v and the attention
  output (2 q + 2 kv: q = heads x head_dim, kv = kv_heads x head_dim), gate, up, silu(gate) and
  their product (4 I); families add their norms' (q / k norm: 2 q + 2 kv; Gemma's two more
  norms: 4 H) and Gemma's embedding scale H;
  the embedding and final norm add 3 H and RoPE's cos / sin 2 head_dim per rope table (Gemma 3's
  sliding layers have their own). A mixture-of-experts layer (Qwen3-MoE, ``ModelConfig.is_moe``)
  keeps, instead of the dense 4 I, the router's fp32 softmax (4 E bytes per token, E = num_experts)
  and for each of the token's k = num_experts_per_tok routed copies its permuted input, the
  expert's gate, up, silu(gate), product and down-projection output (2 H + 4 moe_I: the output is
  kept for the routing weights' gradient): only the active experts' tokens, never E x tokens; Qwen2-MoE's
  shared expert adds a dense MLP's 4 shared_I. With activation
  checkpointing a layer keeps only its input (H), and one layer is recomputed at a time in the
  backward; activation offload moves the kept inputs to host memory;
* ``backward``: the gradient of the residual stream entering the backward (2 H per token);
* ``gathered``: under FSDP (``fsdp > 1``) what FSDP2 holds unsharded, the per-layer working set
  no shard count reduces: the root unit's parameters (embedding, final norm, ``lm_head``: kept
  gathered from forward to backward, the loss reads ``lm_head`` after the forward), two decoder
  layers' (the one computed and the one prefetched) and the computed layer's gradient in fp32
  (the reduce dtype) before its reduce-scatter;
* ``loss``: the fused loss (dk.fused_linear_policy_loss, torch path): the fp32 weight gradient
  [V, H] and hidden gradient [tokens, H] it computes in the forward, and its logits workspace,
  two fp32 [C, V] buffers plus one [C, V] gradient chunk, C = min(tokens, 64 MiB / (8 V)) rows.

The peak is the larger of two moments: the start of the backward, ``params + optimizer +
activations + backward + loss + gathered`` (gradients are set to None after each step, so they grow as the
backward frees activations: with one micro-batch per mini-batch they have not been allocated yet),
and the optimizer step, ``params + grads + optimizer + optimizer_step``. With several micro-batches
per mini-batch the gradients of the earlier ones are there at the later ones' backward:
``micro_batches > 1`` adds ``grads`` to the first moment. Sequence parallelism divides the tokens a rank
holds by its size, but for RoPE's cos / sin (the whole micro-batch's on every rank).
:func:`rollout_memory` counts the rollout engine: its weights and the KV cache of the sequences
generated at once. ``benchmarks/bench_memory_model.py`` checks the training side
against the peak measured on the CPU.

Pipeline parallelism (``Parallel.pp`` ranks, ``vpp`` chunks each; :mod:`dapo_trainer.parallel.pipeline`)
is counted per pipeline rank (:func:`stage_memory`) and :func:`train_memory` answers the largest.
Rank ``r`` holds ``num_layers / pp`` layers, the embedding on the first rank, the final norm and
``lm_head`` on the last (a copy of a tied embedding). Its activations are one micro-batch's through
those layers times the micro-batches in flight: ``pp - r`` under 1F1B (the first rank ``pp``),
``pp - r + (pp - 1) / vpp`` full-stage units under interleaving, at most ``micro_batches``; the final
norm's 3 H and the loss on the last rank only, RoPE's cos / sin on every rank, and on every rank
but the last its output kept for the backward (H). ``pipe``: the engine's receive buffers,
allocated for every micro-batch of a schedule (``PipelineStage``): on all but the first rank the
inputs of the update's schedule, their gradients and the inputs of one forward-only schedule (old
log-probs), on all but the last the output gradients: each ``micro_batches x tokens x H``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

from .model import ModelConfig

LOSS_CHUNK_BYTES = 64 << 20  # dapo_kernels' TORCH_CHUNK_BYTES: the fused loss' fp32 logits per chunk
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class Parallel:
    tp: int = 1
    fsdp: int = 1  # ranks the parameters, gradients and optimizer states are sharded over
    sp: int = 1
    pp: int = 1  # pipeline ranks: the decoder layers split over them
    vpp: int = 1  # model chunks per pipeline rank (interleaved 1F1B)


def layer_activation_bytes(cfg: ModelConfig, layer: int, dtype_bytes: int) -> float:
    """Bytes per token autograd keeps for decoder layer ``layer`` (module doc: dense or MoE MLP)."""
    H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * D, cfg.num_kv_heads * D
    attn = (6 * H + 4 * H * cfg.sandwich_norms + (2 + 2 * cfg.qk_norm) * (q + kv)) * dtype_bytes
    if cfg.is_moe(layer):
        return attn + cfg.num_experts_per_tok * (2 * H + 4 * cfg.moe_intermediate_size) * dtype_bytes \
            + 4 * cfg.num_experts + 4 * cfg.shared_expert_intermediate_size * dtype_bytes
    return attn + 4 * I * dtype_bytes


def activation_bytes_per_token(cfg: ModelConfig, dtype_bytes: int, checkpointing: bool) -> Dict[str, float]:
    """``{"kept": bytes per token kept for the backward, "layer": the largest layer's full set,
    "layers": each layer's full set}``."""
    H, D = cfg.hidden_size, cfg.head_dim
    layers = [layer_activation_bytes(cfg, i, dtype_bytes) for i in range(cfg.num_layers)]
    outer = (3 * H + H * cfg.embed_scale + 2 * D * rope_tables(cfg)) * dtype_bytes
    kept = (cfg.num_layers * H * dtype_bytes if checkpointing else sum(layers)) + outer
    return {"kept": kept, "layer": max(layers), "layers": layers}


def rope_tables(cfg: ModelConfig) -> int:
    """How many cos / sin tables a forward computes (2 when sliding layers have a rope of their own)."""
    return len({cfg.local_rope(i) for i in range(cfg.num_layers)})


def stage_params(cfg: ModelConfig, pp: int = 1, rank: int = 0) -> int:
    """Parameters (unsharded) on pipeline rank ``rank`` of ``pp``: its ``num_layers / pp`` layers,
    the embedding on the first rank, the final norm and ``lm_head`` on the last (ValueError unless
    ``pp`` divides the layers); at ``pp=1`` ``cfg.num_params()``."""
    if pp < 1 or cfg.num_layers % pp:
        raise ValueError(f"par.pp={pp} must be >= 1 and divide the model's {cfg.num_layers} decoder layers")
    if not 0 <= rank < pp:
        raise ValueError(f"rank must be in [0, {pp}), got {rank}")
    if pp == 1:
        return cfg.num_params()
    H, E = cfg.hidden_size, cfg.vocab_size * cfg.hidden_size
    layers = sum(cfg.layer_params(i) for i in _stage_layers(cfg, pp, rank))
    # Under PP the last rank holds lm_head, or with tied embeddings a copy of the embedding.
    return layers + (E if rank == 0 else 0) + (H + E if rank == pp - 1 else 0)


def _stage_layers(cfg: ModelConfig, pp: int, rank: int) -> range:
    """The decoder layers of pipeline rank ``rank``'s contiguous share (for parameter counts)."""
    per = cfg.num_layers // pp
    return range(rank * per, (rank + 1) * per)


def _rank_layers(num_layers: int, pp: int, vpp: int, rank: int) -> list:
    """The decoder layers pipeline rank ``rank`` holds: chunks ``rank, rank + pp, ...`` of ``pp x vpp``."""
    per = num_layers // (pp * vpp)
    return [i for c in range(rank, pp * vpp, pp) for i in range(c * per, (c + 1) * per)]


def in_flight(pp: int, vpp: int, rank: int, micro_batches: int) -> float:
    """Micro-batches whose activations pipeline rank ``rank`` holds at once, in units of one
    micro-batch through its ``num_layers / pp`` layers (benchmarks/bench_pipeline.py measures them)."""
    return min(float(micro_batches), pp - rank + ((pp - 1) / vpp if vpp > 1 else 0))


def stage_memory(cfg: ModelConfig, tokens: int, rank: int = 0, *, dtype: str = "float32",
                 checkpointing: bool = False, offload: bool = False, par: Parallel = Parallel(),
                 micro_batches: int = 1, foreach: bool = True) -> Dict[str, float]:
    """Bytes on pipeline rank ``rank`` of one update step on micro-batches of ``tokens`` tokens
    (see the module doc); ``micro_batches``: per mini-batch (under PP at least ``pp x vpp``)."""
    pp, v = par.pp, par.vpp
    if pp > 1 and micro_batches < pp * v:
        raise ValueError(f"micro_batches={micro_batches} must be >= par.pp x par.vpp = {pp * v}: "
                         "every pipeline stage needs a micro-batch")
    b = DTYPE_BYTES[dtype]
    first, last = rank == 0, rank == pp - 1
    whole = sum(cfg.moe_params(i) for i in _stage_layers(cfg, pp, rank))  # sparse MLPs: not split by TP
    P = (stage_params(cfg, pp, rank) - whole) / (par.tp * par.fsdp) + whole / par.fsdp
    t = -(-tokens // par.sp)  # tokens this rank holds
    V, H = cfg.vocab_size / par.tp, cfg.hidden_size
    layers = cfg.num_layers // pp
    act = activation_bytes_per_token(cfg, b, checkpointing)
    held = _rank_layers(cfg.num_layers, pp, v, rank) if pp > 1 else range(cfg.num_layers)
    others = sum(act["layers"]) - sum(act["layers"][i] for i in held)  # the other ranks' layers
    # One micro-batch through this rank's layers; at pp=1 act["kept"] (its outer 3 H + 2 D on the one rank).
    kept = (act["kept"] - ((cfg.num_layers - layers) * H * b if checkpointing else others)
            - (0 if last else 3 * H * b) + (0 if last else H * b))
    kept -= layers * H * b if offload and checkpointing else 0
    activations = in_flight(pp, v, rank, micro_batches) * t * kept + (t * act["layer"] if checkpointing else 0)
    activations += (tokens - t) * 2 * cfg.head_dim * rope_tables(cfg) * b  # SP: the other ranks' rows of cos / sin
    rows = max(1, min(t, LOSS_CHUNK_BYTES // (8 * V)))
    experts = 2 * cfg.num_experts * cfg.moe_intermediate_size * H if cfg.num_experts else 0  # stacked gate / up
    largest = max(V * H if first or last else 0, cfg.intermediate_size * H / par.tp, experts) / par.fsdp
    # FSDP2's unsharded units on this rank: its stage's root (embedding / norm + lm_head) and two layers.
    root = (V * H if first else 0) + (V * H + H if last else 0) - (V * H if first and last and cfg.tie_word_embeddings
                                                                   else 0)
    layer = max((cfg.layer_params(i) - cfg.moe_params(i)) / par.tp + cfg.moe_params(i)  # sparse MLPs: whole
                for i in range(cfg.num_layers))
    gathered = (root * b + 2 * layer * b + 4 * layer) if par.fsdp > 1 else 0.0
    out = {"params": P * b, "grads": P * b, "optimizer": 2 * P * b, "optimizer_step": (P if foreach else largest) * b,
           "activations": activations, "backward": t * 2 * H * b,
           "loss": 4 * V * H + 4 * t * H + 3 * 4 * rows * V if last else 0.0,
           "gathered": gathered,
           "pipe": micro_batches * t * H * b * ((0 if first else 3) + (0 if last else 1)) if pp > 1 else 0.0}
    backward = (out["params"] + out["optimizer"] + out["activations"] + out["backward"] + out["loss"] + out["pipe"]
                + out["gathered"] + (out["grads"] if micro_batches > 1 else 0))
    out["peak"] = max(backward, out["params"] + out["grads"] + out["optimizer"] + out["optimizer_step"] + out["pipe"])
    out["stage"] = rank
    return out


def train_memory(cfg: ModelConfig, tokens: int, *, dtype: str = "float32", checkpointing: bool = False,
                 offload: bool = False, par: Parallel = Parallel(), micro_batches: int = 1,
                 foreach: bool = True) -> Dict[str, float]:
    """Bytes per rank of one update step on micro-batches of ``tokens`` tokens (see the module doc):
    under PP the pipeline rank with the largest peak (its index in ``"stage"``)."""
    stages = [stage_memory(cfg, tokens, r, dtype=dtype, checkpointing=checkpointing, offload=offload, par=par,
                           micro_batches=micro_batches, foreach=foreach) for r in range(par.pp)]
    return max(stages, key=lambda m: m["peak"])


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int, tp: int = 1) -> float:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes / tp


def rollout_memory(cfg: ModelConfig, sequences: int, seq_len: int, *, dtype_bytes: int = 2,
                   tp: int = 1) -> Dict[str, float]:
    """The rollout engine's weights and the KV cache of ``sequences`` sequences of ``seq_len`` tokens."""
    return {"weights": cfg.num_params() * dtype_bytes / tp,
            "kv_cache": sequences * seq_len * kv_bytes_per_token(cfg, dtype_bytes, tp)}
