"""Mistakes that used to fail late or deep inside (issue 40, items 14 and 15) are errors at start-up,
before any model is built or file written, naming the dotted key or the file (and line)."""
import pytest

from dapo_trainer.config import load_config


# --------------------------------------------------------------------------- item 14: float16 weights
def test_float16_parameters_refused_at_load_naming_the_key_and_the_way_out():
    """actor_rollout_ref.model.dtype=float16 is refused at load (AdamW in float16 turns the weights
    inf / NaN at the first step); bfloat16 and float32 load."""
    with pytest.raises(ValueError, match=r"config key 'actor_rollout_ref.model.dtype': float16 .*inf / NaN.*bfloat16"):
        load_config(overrides=["actor_rollout_ref.model.dtype=float16"])
    for dtype in ("bfloat16", "float32"):
        assert load_config(overrides=[f"actor_rollout_ref.model.dtype={dtype}"]).actor_rollout_ref.model.dtype == dtype
