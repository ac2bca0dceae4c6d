"""verl-facing functions with verl 0.9's exact signatures, and :func:`apply` / :func:`revert`, which
patch a verl installation in place to run them.

Note the argument order: verl passes ``(old_log_prob, log_prob, ...)`` while
:func:`dapo_kernels.policy_loss` takes ``(log_prob, old_log_prob, ...)``; a positional call
swapped between the two would silently invert the ratio. The functions here take verl's order.

Semantic differences from verl 0.9.1 (also listed in each docstring):

* ``compute_policy_loss_vanilla``: a NaN / inf in a masked-out token is selected away (verl's
  float-mask products turn it into NaN); ``seq-mean-token-mean`` divides by the token count, verl
  by ``count + 1e-8`` (a 1e-8 relative difference); ``rollout_is_weights`` are constants (no
  gradient flows into them); a float ``response_mask`` must be 0 / 1.
* ``compute_grpo_outcome_advantage``: statistics in float64; a group whose scores are all equal
  gets advantages exactly 0; a group holding a NaN / inf score gets advantages 0 (verl: NaN).
* ``get_seqlen_balanced_partitions`` / ``rearrange_micro_batches``: the same contract (every index
  once, sorted partitions, the token cap), but :func:`dapo_kernels.balanced_partitions` /
  :func:`dapo_kernels.micro_batches` find different (never less balanced than plain
  Karmarkar-Karp / never more micro-batches than verl's search, see their docs) partitions;
  violations raise ``ValueError`` where verl asserts.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from .. import balancing
from .._validation import check_mask
from ..flash_attn_compat import bert_padding
from ..ops.group_filter import group_filter
from ..ops.policy_loss import (aggregation_weights, check_agg, check_clips, check_is_weights, metrics_from_counts,
                               policy_loss_sums)

__all__ = ["compute_policy_loss_vanilla", "compute_grpo_outcome_advantage", "get_seqlen_balanced_partitions",
           "rearrange_micro_batches", "apply", "revert", "POLICY_LOSS_NAME"]

# The name the fused loss is registered under in verl's policy-loss registry by apply()
# (besides replacing "vanilla"): ``actor.policy_loss.loss_mode=dapo_kernels``.
POLICY_LOSS_NAME = "dapo_kernels"


def _cfg(config, name: str, default=None):
    """``config.name`` for verl's dataclass configs, omegaconf dicts and plain dicts alike."""
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Optional[Any] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, float]]:
    """verl's ``compute_policy_loss_vanilla`` (decoupled clip + dual clip + ``agg_loss`` with
    ``config.global_batch_info``) on :func:`dapo_kernels.policy_loss`'s kernels.

    ``config``: verl's ``ActorConfig`` (or a dict): ``clip_ratio``, ``clip_ratio_low`` /
    ``clip_ratio_high`` (None: ``clip_ratio``), ``clip_ratio_c`` (default 3.0),
    ``global_batch_info`` (``dp_size``, ``batch_num_tokens``, ``global_batch_size``,
    ``loss_scale_factor``). Returns ``(pg_loss, {"actor/pg_clipfrac", "actor/ppo_kl",
    "actor/pg_clipfrac_lower"})`` with Python float metrics, as verl (one host read for the three).
    ``rollout_is_weights`` (verl's rollout correction, shaped like ``log_prob``) go to the op's kernels,
    which scale each token's loss by its weight before the aggregation (no extra pass).
    """
    if config is None:
        raise ValueError("config is required (verl's ActorConfig: clip_ratio, clip_ratio_low/high, clip_ratio_c)")
    clip = _cfg(config, "clip_ratio")
    low, high = _cfg(config, "clip_ratio_low"), _cfg(config, "clip_ratio_high")
    clips = check_clips(clip if low is None else low, clip if high is None else high,
                        _cfg(config, "clip_ratio_c", 3.0))
    info = dict(_cfg(config, "global_batch_info", None) or {})
    dp_size = info.get("dp_size", 1)
    if dp_size > 1:
        need = "batch_num_tokens" if loss_agg_mode == "token-mean" else "global_batch_size"
        if loss_agg_mode != "token-sum" and info.get(need) is None:
            raise ValueError(f"(global) {need} is required when dp_size > 1")
    mask = check_mask("response_mask", response_mask, device=log_prob.device, shape=tuple(log_prob.shape))
    check_agg(loss_agg_mode, log_prob, None)
    is_w = check_is_weights(rollout_is_weights, log_prob)
    w = aggregation_weights(mask, loss_agg_mode, num_tokens=info.get("batch_num_tokens"),
                            num_seqs=info.get("global_batch_size"), loss_scale_factor=info.get("loss_scale_factor"))
    flat = [t.reshape(-1).contiguous() for t in (log_prob, old_log_prob, advantages, mask)]
    sums = policy_loss_sums(*flat, w, *clips, is_w)  # (w: 1 or N contiguous elements, as policy_loss's)
    metrics = metrics_from_counts(sums[1], sums[2], sums[3], sums[4])
    clipfrac, ppo_kl, lower = torch.stack([metrics["pg_clipfrac"], metrics["ppo_kl"],
                                           metrics["pg_clipfrac_lower"]]).tolist()
    loss = (sums[0] * dp_size).to(log_prob.dtype)
    return loss, {"actor/pg_clipfrac": clipfrac, "actor/ppo_kl": ppo_kl, "actor/pg_clipfrac_lower": lower}


def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Optional[Any] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """verl's GRPO outcome advantage on :func:`dapo_kernels.group_filter`: ``[B, T]`` rewards summed per
    response, grouped by ``index`` (the uid array, any hashable values), ``(s - mean) / (std + eps)``
    with the unbiased std (singletons: mean 0, std 1), broadcast over ``response_mask``.
    Returns ``(advantages, returns)``, the same tensor twice, as verl."""
    mask = check_mask("response_mask", response_mask, device=token_level_rewards.device,
                      shape=tuple(token_level_rewards.shape))
    scores = token_level_rewards.sum(dim=-1)
    _, inverse = np.unique(np.asarray(index), return_inverse=True)
    group_index = torch.as_tensor(inverse.reshape(-1), dtype=torch.int64, device=scores.device)
    res = group_filter(scores.detach().float(), group_index, int(inverse.max()) + 1 if inverse.size else 0,
                       epsilon=epsilon, norm_adv_by_std=norm_adv_by_std_in_grpo)
    adv = (res.advantages.to(scores.dtype)[:, None] * mask).to(token_level_rewards.dtype)
    return adv, adv


def get_seqlen_balanced_partitions(seqlen_list: List[int], k_partitions: int, equal_size: bool) -> List[List[int]]:
    """verl's partitioner on :func:`dapo_kernels.balanced_partitions`: ``k_partitions`` non-empty,
    sorted index lists covering ``range(len(seqlen_list))``."""
    return balancing.balanced_partitions(seqlen_list, k_partitions, equal_size)


def rearrange_micro_batches(
    batch,
    max_token_len,
    dp_group=None,
    num_batches_divided_by=None,
    same_micro_num_in_dp=True,
    min_num_micro_batch=None,
    use_dynamic_bsz_balance=True,
    force_group_size=1,
):
    """verl's token-capped micro-batching of a TensorDict on :func:`dapo_kernels.micro_batches`.

    Returns ``(micro_batches, micro_bsz_idx)``: the micro-batch TensorDicts and their index lists.
    Token counts from ``attention_mask`` (or a nested ``input_ids``' offsets), workloads verl's
    ``24576 L + L^2`` (:func:`dapo_kernels.attention_workload`), ``force_group_size`` consecutive
    samples kept together; with ``dp_group`` (and ``same_micro_num_in_dp``) every rank gets the
    largest rank's count; ``use_dynamic_bsz_balance`` orders them by
    :func:`dapo_kernels.pipeline_order` (light at both ends).
    """
    input_ids = batch["input_ids"]
    if input_ids.is_nested:
        seqlens = input_ids.offsets().diff()
        padded_len = int(seqlens.max()) if seqlens.numel() else 0
    else:
        seqlens = batch["attention_mask"].sum(dim=1)
        padded_len = batch["attention_mask"].shape[-1]
    if max_token_len < padded_len:
        raise ValueError(f"max_token_len must be >= the sequence length, got {max_token_len=} and {padded_len=}")
    n = seqlens.shape[0]
    if force_group_size < 1 or n % force_group_size:
        raise ValueError(f"batch size {n} must be a multiple of force_group_size {force_group_size}")
    seqlens = seqlens.long().cpu()
    work = balancing.attention_workload(seqlens, 4096)  # h = 4096: verl's 24576 L + L^2
    groups = n // force_group_size
    g_tokens = seqlens.view(groups, force_group_size).sum(1).numpy()
    g_work = work.reshape(groups, force_group_size).sum(1)
    kw = dict(workloads=g_work, min_num_micro_batches=min_num_micro_batch or 1,
              num_micro_batches_multiple_of=num_batches_divided_by or 1)
    parts = balancing.micro_batches(g_tokens, max_token_len, **kw)
    import torch.distributed as dist

    if dist.is_initialized() and same_micro_num_in_dp and dp_group is not None:
        count = torch.tensor([len(parts)], dtype=torch.int64)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=dp_group)
        if int(count) != len(parts):
            parts = balancing.micro_batches(g_tokens, max_token_len, **dict(kw, min_num_micro_batches=int(count)))
    if use_dynamic_bsz_balance:
        parts = [parts[i] for i in balancing.pipeline_order(parts, g_work)]
    idx = [[g * force_group_size + j for g in part for j in range(force_group_size)] for part in parts]
    return [batch[torch.tensor(i, dtype=torch.long)] for i in idx], idx


# --------------------------------------------------------------------------- patching
# (module, attribute) -> original object, for revert(); empty when not applied.
_ORIGINALS: Dict[Tuple[str, str], Any] = {}
_REGISTRY_ORIGINALS: List[Tuple[dict, str, Any]] = []  # (registry, key, original or _MISSING)
_MISSING = object()


def _replace_everywhere(module_name: str, name: str, new) -> None:
    """Set ``module.name = new`` and rebind every ``verl.*`` module attribute holding the original
    object (``from verl.utils.seqlen_balancing import rearrange_micro_batches`` copies it)."""
    original = getattr(sys.modules[module_name], name)
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not (mod_name == "verl" or mod_name.startswith("verl.")):
            continue
        for attr, value in list(vars(mod).items()):
            if value is original:
                _ORIGINALS.setdefault((mod_name, attr), original)
                setattr(mod, attr, new)


# What apply() replaces: (verl module, name, the module whose attribute of that name replaces it; read
# at apply() time, so a wrapper installed there, as the verl test plugin's call counters, is what verl gets).
PATCHES = tuple((module, name, sys.modules[__name__] if holder is None else holder) for module, name, holder in (
    ("verl.trainer.ppo.core_algos", "compute_policy_loss_vanilla", None),
    ("verl.trainer.ppo.core_algos", "compute_grpo_outcome_advantage", None),
    ("verl.utils.seqlen_balancing", "get_seqlen_balanced_partitions", None),
    ("verl.utils.seqlen_balancing", "rearrange_micro_batches", None),
    ("verl.utils.attention_utils", "unpad_input", bert_padding),
    ("verl.utils.attention_utils", "pad_input", bert_padding),
    ("verl.utils.attention_utils", "index_first_axis", bert_padding),
))


def _import_verl():
    """verl's modules that :func:`apply` patches (its ``core_algos`` returned); a missing package is an
    ImportError naming it and how to install it (verl's own import of ray fails with a bare one)."""
    import importlib
    import importlib.util

    try:
        core_algos = importlib.import_module("verl.trainer.ppo.core_algos")
        importlib.import_module("verl.utils.seqlen_balancing")
        importlib.import_module("verl.utils.attention_utils")
    except ModuleNotFoundError as e:
        name = e.name or ""
        if name == "verl" or (name.startswith("verl.") and importlib.util.find_spec("verl") is None):
            raise ImportError("dapo_kernels.integrations.verl.apply() needs verl (0.9.x), which is not installed: "
                              "pip install verl", name="verl") from e
        if name.startswith("verl."):
            raise ImportError(f"dapo_kernels.integrations.verl.apply() patches verl 0.9.x; this verl has no module "
                              f"{name}", name=name) from e
        top = name.split(".")[0]
        raise ImportError(f"dapo_kernels.integrations.verl.apply(): verl needs {top}, which is not installed "
                          f"(verl imports it: {e}): pip install {top}", name=top) from e
    return core_algos


def apply() -> None:
    """Patch the imported verl (0.9.x) in place: the "vanilla" policy loss (and a new
    ``"dapo_kernels"`` entry) and the "grpo" advantage estimator in verl's registries,
    ``verl.utils.seqlen_balancing``'s partition / micro-batch functions, and
    ``verl.utils.attention_utils``' remove-padding helpers. Idempotent; :func:`revert` undoes it."""
    if _REGISTRY_ORIGINALS:
        return
    core_algos = _import_verl()
    for reg, key, new in ((core_algos.POLICY_LOSS_REGISTRY, "vanilla", compute_policy_loss_vanilla),
                          (core_algos.POLICY_LOSS_REGISTRY, POLICY_LOSS_NAME, compute_policy_loss_vanilla),
                          (core_algos.ADV_ESTIMATOR_REGISTRY, "grpo", compute_grpo_outcome_advantage)):
        _REGISTRY_ORIGINALS.append((reg, key, reg.get(key, _MISSING)))
        reg[key] = new
    for module, name, holder in PATCHES:
        _replace_everywhere(module, name, getattr(holder, name))


def revert() -> None:
    """Undo :func:`apply` (a no-op if it was not applied)."""
    for (mod_name, attr), original in _ORIGINALS.items():
        setattr(sys.modules[mod_name], attr, original)
    for reg, key, original in reversed(_REGISTRY_ORIGINALS):
        if original is _MISSING:
            reg.pop(key, None)
        else:
            reg[key] = original
    _ORIGINALS.clear()
    _REGISTRY_ORIGINALS.clear()
