"""dapo_trainer: the reference DAPO / GRPO trainer built on dapo_kernels.

The model (:mod:`dapo_trainer.model`) is a plain Llama / Qwen2 decoder on packed
sequences; :mod:`dapo_trainer.hf_io` loads and saves Hugging Face checkpoints and
:mod:`dapo_trainer.parallel` applies tensor / data parallelism to it.
"""
from .hf_io import config_from_hf, config_to_hf, load_hf_model, read_hf_config, save_hf_model
from .model import ModelConfig, Transformer

__all__ = [
    "ModelConfig",
    "Transformer",
    "load_hf_model",
    "save_hf_model",
    "read_hf_config",
    "config_from_hf",
    "config_to_hf",
]
