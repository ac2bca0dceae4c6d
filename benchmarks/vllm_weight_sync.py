"""Time of ``VLLMRollout.update_weights`` (the policy's weights into the running vLLM engine).

    .venv-vllm/bin/python -m benchmarks.vllm_weight_sync --model demo|0.5b [--repeats 3]

``demo``: the demo's tiny Llama (float32); ``0.5b``: a random model of Qwen2.5-0.5B's shape
(494M parameters, tied embeddings, bfloat16). Prints the median of ``--repeats`` syncs after a
warm-up one.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from dapo_trainer.model import ModelConfig, Transformer
from dapo_trainer.rollout import RolloutConfig, make_rollout

MODELS = {
    "demo": (dict(vocab_size=32, hidden_size=128, intermediate_size=384, num_layers=2, num_heads=2, num_kv_heads=2,
                  head_dim=64, max_position_embeddings=128), torch.float32),
    "0.5b": (dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
                  num_kv_heads=2, head_dim=64, max_position_embeddings=128, qkv_bias=True, tie_word_embeddings=True,
                  model_type="qwen2"), torch.bfloat16),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(MODELS), default="demo")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cfg, dtype = MODELS[args.model]
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**cfg)).init_weights(std=0.02).to(dtype).eval()
    print(f"{args.model}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {dtype}", flush=True)
    engine = make_rollout(RolloutConfig(name="vllm", max_model_len=128, kv_cache_memory_bytes=64 << 20), model)
    times = []
    try:
        for _ in range(args.repeats + 1):
            t0 = time.perf_counter()
            engine.update_weights(model)
            times.append(time.perf_counter() - t0)
    finally:
        engine.close()
    print(f"{args.model}: update_weights median {statistics.median(times[1:]):.3f} s "
          f"(runs {', '.join(f'{t:.3f}' for t in times)})", flush=True)


if __name__ == "__main__":
    main()
