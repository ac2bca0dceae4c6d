"""The ops' argument checks, for code built on the ops (the reference trainer, users' own models).

Same contract as the ops: every check raises before anything is written, ``TypeError`` for a
wrong Python type and ``ValueError`` for a wrong shape, dtype, device or content, with a
message naming the argument.

* :func:`check_tensor` ``(name, t, *, ndim, dtypes, device, shape)`` - a tensor argument;
* :func:`check_int` / :func:`check_float` / :func:`check_flag` - Python scalars (bool is not a number);
* :func:`check_float_or_tensor` - a number that may also come as a 1-element tensor, whose value is
  checked on the device without a host sync (a ``RuntimeError`` from ``torch._assert_async``);
* :func:`check_cu_seqlens` ``(cu_seqlens, total_tokens)`` - packed-sequence boundaries (one host sync);
* :func:`to_device_checked` ``(t, device)`` - copy host-built integer data (ids, labels, ``cu_seqlens``)
  to the device with its checked facts, so the ops' checks of the copy read nothing;
* :func:`check_mask` ``(name, mask, *, ndim, device, shape)`` - a token mask (bool, integer or float
  0 / 1; a float mask's values checked on the device) returned as bool;
* :func:`check_clip_ratios` ``(clip_ratio_low, clip_ratio_high, clip_ratio_c)`` - the PPO clip ratios,
  each against its rule in ``CLIP_RATIO_RANGES``;
* :func:`check_rollout_correction` ``(rollout_is, rollout_is_threshold, ...)`` - ``rollout_correction``'s
  options (verl's ``algorithm.rollout_correction`` keys), parsed as the op parses them, no tensor;
* ``FLOAT_DTYPES`` / ``INT_DTYPES`` / ``MASK_DTYPES`` - the dtypes the ops accept for floats / integer
  ids / masks.
"""
from typing import Tuple

from ._validation import (FLOAT_DTYPES, INT_DTYPES, MASK_DTYPES, check_cu_seqlens, check_flag, check_float,
                          check_float_or_tensor, check_int, check_mask, check_tensor, to_device_checked)
from ._rollout_spec import make_params

# (valid, expected) of each clip ratio, as check_float takes them: the one rule of the loss ops and
# of the trainer config's actor_rollout_ref.actor.clip_ratio_* keys.
CLIP_RATIO_RANGES = {
    "clip_ratio_low": (lambda v: 0.0 <= v < 1.0, "in [0, 1)"),
    "clip_ratio_high": (lambda v: v >= 0.0, ">= 0"),
    "clip_ratio_c": (lambda v: v > 1.0, "> 1 (dual-clip lower bound)"),
}


def check_clip_ratios(clip_ratio_low, clip_ratio_high, clip_ratio_c) -> Tuple[float, float, float]:
    """The three clip ratios as floats, each checked against its rule in ``CLIP_RATIO_RANGES``."""
    values = (clip_ratio_low, clip_ratio_high, clip_ratio_c)
    return tuple(check_float(name, v, valid=valid, expected=expected)
                 for (name, (valid, expected)), v in zip(CLIP_RATIO_RANGES.items(), values))


def check_rollout_correction(rollout_is=None, rollout_is_threshold=2.0, rollout_is_batch_normalize: bool = False,
                             rollout_rs=None, rollout_rs_threshold=None) -> None:
    """``dk.rollout_correction``'s options checked exactly as the op checks them, before any tensor
    exists (a trainer's config load): ``ValueError`` / ``TypeError`` whose message starts with the
    argument's name."""
    check_flag("rollout_is_batch_normalize", rollout_is_batch_normalize)
    make_params(rollout_is, rollout_is_threshold, rollout_is_batch_normalize, rollout_rs, rollout_rs_threshold)


__all__ = ["check_tensor", "check_int", "check_float", "check_flag", "check_float_or_tensor", "check_cu_seqlens",
           "check_mask", "to_device_checked", "check_clip_ratios", "check_rollout_correction", "CLIP_RATIO_RANGES",
           "FLOAT_DTYPES", "INT_DTYPES", "MASK_DTYPES"]
