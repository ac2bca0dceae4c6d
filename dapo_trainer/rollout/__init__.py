"""Rollout engines: generate ``n`` responses per prompt from the current policy.

::

    engine = make_rollout(config, model)     # config.rollout.name (or config.name): "embedded" | "vllm"
    out = engine.generate(prompt_ids, n, max_new_tokens, temperature=1.0, top_p=1.0, seed=None,
                          stop_token_ids=(eos,))
    engine.update_weights(model)             # after each optimiser step

``out`` is a :class:`RolloutOutput` (packed responses, log-probs, group index); the
log-prob convention is in :mod:`.base`.
"""
from dataclasses import fields

from .base import ENGINES, FINISH_LENGTH, FINISH_STOP, RolloutConfig, RolloutEngine, RolloutOutput
from .embedded import EmbeddedRollout, naive_generate


def make_rollout(config, model) -> RolloutEngine:
    """Build the engine named by the config, for ``model`` (a dapo_trainer ``Transformer``).

    Args:
        config: a :class:`RolloutConfig`, or an object with a ``rollout`` attribute that is
            one; any object with a string ``name`` and (some of) RolloutConfig's attribute
            names also works (missing ones take the defaults).
        model: the policy (possibly TP- / FSDP2-sharded); the embedded engine samples from
            it, vLLM receives its gathered weights in memory.
    """
    cfg = getattr(config, "rollout", config)
    if not isinstance(cfg, RolloutConfig):
        # Any object with the same attribute names (the trainer's own rollout section).
        if not isinstance(getattr(cfg, "name", None), str):
            raise TypeError("config must be a RolloutConfig, or an object with a string `name` (or a `.rollout` "
                            f"holding one), got {type(config).__name__}")
        cfg = RolloutConfig(**{f.name: getattr(cfg, f.name) for f in fields(RolloutConfig) if hasattr(cfg, f.name)})
    if cfg.name == "embedded":
        return EmbeddedRollout(model, cfg)
    if cfg.name == "vllm":
        from .vllm_engine import VLLMRollout

        return VLLMRollout(model, cfg)
    raise ValueError(f"config.rollout.name must be one of {ENGINES}, got {cfg.name!r}")


__all__ = ["make_rollout", "RolloutConfig", "RolloutOutput", "RolloutEngine", "EmbeddedRollout", "naive_generate",
           "FINISH_STOP", "FINISH_LENGTH", "ENGINES"]
