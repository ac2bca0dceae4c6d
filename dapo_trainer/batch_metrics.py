"""Statistics of a step's train batch (after dynamic sampling)."""
from __future__ import annotations

from typing import Dict

from .records import TrainBatch


def batch_metrics(batch: TrainBatch, max_response_length: int) -> Dict[str, float]:
    """Reward, accuracy and length statistics of the train batch."""
    rl = batch.response_len.double()
    return {"critic/score/mean": float(batch.score.mean()), "critic/rewards/mean": float(batch.reward.mean()),
            "critic/advantages/mean": float(batch.advantages.mean()), "acc/mean": float(batch.acc.mean()),
            "response_length/mean": float(rl.mean()), "response_length/max": float(rl.max()),
            "response_length/min": float(rl.min()),
            "response_length/clip_ratio": float((~batch.stopped).double().mean()),
            # Responses that carry a gradient (GRPO: all-equal groups have zero advantage).
            "train/effective_batch": float((batch.advantages != 0).sum()),
            "prompt_length/mean": float(batch.prompt_len.double().mean()),
            "train/num_tokens": float(batch.sampled.sum())}
