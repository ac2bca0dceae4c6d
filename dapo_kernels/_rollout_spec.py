"""The options of ``rollout_correction`` as verl 0.9.1 spells them, parsed on the host into
:class:`CorrectionParams`, and the names of the metrics they produce.

verl's ``algorithm.rollout_correction`` keys: ``rollout_is`` (``None`` / ``"token"`` /
``"sequence"``), ``rollout_is_threshold`` (a number or numeric string: truncate at it; a
``"lower_upper"`` string: IcePop, zero the weights outside ``[lower, upper]``),
``rollout_is_batch_normalize``, ``rollout_rs`` (comma-separated :data:`RS_OPTIONS`) and
``rollout_rs_threshold`` (one spec for all options or one per option; ``*_k1`` options take ratio
bounds ``"lower_upper"`` or an upper bound ``u`` meaning ``1/u_u``, compared in log space; the
others take one upper bound). Bad values raise ``ValueError`` naming the argument, wrong types
``TypeError`` (as verl). Everything here is plain Python: no tensor is read.
"""
from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Tuple

IS_LEVELS = ("token", "sequence")
# The order of the per-option parameters and of the per-option metrics.
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
TOKEN_RS = RS_OPTIONS[:3]
_NUM_RS = len(RS_OPTIONS)
# verl clamps log-ratios to +-20 before exponentiating ("safety bound").
SAFETY_BOUND = 20.0


class CorrectionParams(NamedTuple):
    """Every scalar of one ``rollout_correction`` call; the custom op takes ``params.as_list()`` (floats)
    and rebuilds it with ``CorrectionParams.from_list``."""
    is_level: float  # 0: no IS weights, 1: token, 2: sequence
    is_upper: float  # truncation bound (TIS) or IcePop's upper bound
    is_lower: float  # IcePop's lower bound, or 1 / upper (TIS: only the metrics use it)
    is_log_upper: float  # log of the bounds in fp32, as verl's sequence-level fractions compare
    is_log_lower: float
    icepop: float  # 1.0: zero weights outside [lower, upper]; 0.0: clamp them to upper
    batch_normalize: float  # 1.0: divide the weights by their batch mean
    mask_eps: float  # added to token counts in means: verl's 1e-8, which only an fp64 mask keeps (fp32 loses it)
    rs_lower: Tuple[float, ...]  # per RS_OPTIONS entry: keep above (k1: log lower bound; others -inf)
    rs_upper: Tuple[float, ...]  # per RS_OPTIONS entry: keep below (k1: log upper bound); NaN: option off

    def as_list(self) -> List[float]:
        return [float(v) for v in self[:8]] + list(self.rs_lower) + list(self.rs_upper)

    @classmethod
    def from_list(cls, values) -> "CorrectionParams":
        v = [float(x) for x in values]
        return cls(*v[:8], tuple(v[8:8 + _NUM_RS]), tuple(v[8 + _NUM_RS:8 + 2 * _NUM_RS]))

    def rs_enabled(self) -> List[str]:
        return [o for o, u in zip(RS_OPTIONS, self.rs_upper) if not math.isnan(u)]


def _number(name: str, text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise ValueError(f"{name}: {text!r} is not a number") from None
    if math.isnan(v):
        raise ValueError(f"{name}: NaN is not a threshold")
    return v


def _fp32(x: float) -> float:
    """``x`` rounded to the nearest fp32 (ties to even; normal range), in plain Python math."""
    if x == 0 or not math.isfinite(x):
        return x
    m, e = math.frexp(x)
    return math.ldexp(round(m * 2.0**24) / 2.0**24, e)


def _log32(x: float) -> float:
    """log(x) as verl takes it for its sequence-level fractions: ``torch.log`` of an fp32 tensor."""
    return _fp32(math.log(_fp32(x))) if x > 0 else -math.inf


def parse_is_threshold(spec) -> Tuple[float, Optional[float]]:
    """(upper, IcePop lower or None) of ``rollout_is_threshold``."""
    name = "rollout_is_threshold"
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise TypeError(f"{name} must be a number or a string such as '2.0' or '0.5_2.0', got {type(spec).__name__}")
    lower = None
    if isinstance(spec, str):
        text = spec.strip()
        if not text:
            raise ValueError(f"{name} must not be an empty string")
        if "_" in text:
            lo, up = text.split("_", 1)
            lower, upper = _number(name, lo), _number(name, up)
        else:
            upper = _number(name, text)
    else:
        upper = _number(name, str(float(spec)))
    if upper <= 0:
        raise ValueError(f"{name}: the upper bound must be > 0, got {upper}")
    if lower is not None and not 0 < lower <= upper:
        raise ValueError(f"{name}: the lower bound must be > 0 and <= the upper bound, got {spec!r}")
    return upper, lower


def parse_rs(options, thresholds) -> dict:
    """``{option: (keep-above, keep-below)}`` of ``rollout_rs`` / ``rollout_rs_threshold``, options
    deduplicated in their first order; k1 bounds as logs of the ratio bounds."""
    if not isinstance(options, str):
        raise ValueError(f"rollout_rs must be a comma-separated string of {RS_OPTIONS}, got {options!r}")
    names = []
    for opt in (o.strip() for o in options.split(",")):
        if opt and opt not in RS_OPTIONS:
            raise ValueError(f"rollout_rs: unknown option {opt!r}; the options are {RS_OPTIONS}")
        if opt and opt not in names:
            names.append(opt)
    if not names:
        raise ValueError(f"rollout_rs must name at least one of {RS_OPTIONS}, got {options!r}")
    name = "rollout_rs_threshold"
    if thresholds is None:
        raise ValueError(f"{name} must be given when rollout_rs is set")
    if isinstance(thresholds, bool) or not isinstance(thresholds, (int, float, str)):
        raise TypeError(f"{name} must be a number or a comma-separated string, got {type(thresholds).__name__}")
    specs = [str(thresholds)] if not isinstance(thresholds, str) else [
        s.strip() for s in thresholds.split(",") if s.strip()]
    if len(specs) not in (1, len(names)):
        raise ValueError(f"{name}: {len(specs)} thresholds for {len(names)} rollout_rs options; give one for all "
                         "or one per option")
    specs = specs * len(names) if len(specs) == 1 else specs
    out = {}
    for opt, spec in zip(names, specs):
        where = f"{name} {spec!r} of option {opt!r}"
        if opt.endswith("k1"):
            lo, up = spec.split("_", 1) if "_" in spec else (None, spec)
            upper = _number(where, up)
            lower = _number(where, lo) if lo is not None else (1.0 / upper if upper != 0 else 0.0)
            if lower <= 0 or upper <= 0 or lower > upper:
                raise ValueError(f"{where}: the bounds must be > 0 with lower <= upper")
            out[opt] = (math.log(lower), math.log(upper))
        else:
            if "_" in spec:
                raise ValueError(f"{where}: only *_k1 options take a 'lower_upper' pair; give one upper bound")
            upper = _number(where, spec)
            if upper <= 0:
                raise ValueError(f"{where}: the bound must be > 0")
            out[opt] = (-math.inf, upper)
    return out


def make_params(rollout_is, rollout_is_threshold, rollout_is_batch_normalize: bool, rollout_rs,
                rollout_rs_threshold, fp64_mask: bool = False) -> CorrectionParams:
    """Parse and check verl's options (verl's rule: no IS weights unless both ``rollout_is`` and
    ``rollout_is_threshold`` are given; the threshold is parsed only then). ``fp64_mask``: the
    response mask is fp64, so verl's means keep their 1e-8 (:attr:`CorrectionParams.mask_eps`)."""
    if rollout_is is not None and rollout_is not in IS_LEVELS:
        raise ValueError(f"rollout_is must be None or one of {IS_LEVELS}, got {rollout_is!r}")
    level, upper, lower, icepop = 0, 2.0, 0.5, False
    if rollout_is is not None and rollout_is_threshold is not None:
        level = IS_LEVELS.index(rollout_is) + 1
        upper, ice_lower = parse_is_threshold(rollout_is_threshold)
        icepop = ice_lower is not None
        lower = ice_lower if icepop else 1.0 / upper
    rs = parse_rs(rollout_rs, rollout_rs_threshold) if rollout_rs is not None else {}
    return CorrectionParams(
        is_level=float(level), is_upper=upper, is_lower=lower, is_log_upper=_log32(upper),
        is_log_lower=_log32(lower), icepop=float(icepop), batch_normalize=float(bool(rollout_is_batch_normalize)),
        mask_eps=1e-8 if fp64_mask else 0.0,
        rs_lower=tuple(rs.get(o, (math.nan, math.nan))[0] for o in RS_OPTIONS),
        rs_upper=tuple(rs.get(o, (math.nan, math.nan))[1] for o in RS_OPTIONS))


_IS_NAMES = ("mean", "max", "min", "ratio_fraction_high", "ratio_fraction_low", "std", "eff_sample_size",
             "seq_mean", "seq_std", "seq_max", "seq_min", "seq_max_deviation", "seq_fraction_high",
             "seq_fraction_low")
_RS_NAMES = ("mean", "max", "min", "fraction_high", "fraction_low", "std", "seq_mean", "seq_std", "seq_max",
             "seq_min", "seq_max_deviation", "seq_fraction_high")
OFFPOLICY_NAMES = ("training_ppl", "training_log_ppl", "kl", "k3_kl", "rollout_ppl", "rollout_log_ppl",
                   "log_ppl_diff", "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio",
                   "chi2_token", "chi2_seq")
PREFIX = "rollout_corr/"


def metric_names(p: CorrectionParams) -> List[str]:
    """verl's metric keys (without ``rollout_corr/``) for ``p``, in the order the op stacks them."""
    names = []
    if p.is_level:
        names += [f"rollout_is_{n}" for n in _IS_NAMES]
        names += ["rollout_is_oob_ratio"] if p.icepop else []
        names += ["rollout_is_batch_norm_factor"] if p.batch_normalize else []
    for opt in p.rs_enabled():
        k1 = ["seq_fraction_low"] if opt.endswith("k1") else []
        names += [f"rollout_rs_{opt}_{n}" for n in (*_RS_NAMES, *k1, "masked_fraction", "seq_masked_fraction")]
    if p.rs_enabled():
        names += ["rollout_rs_masked_fraction", "rollout_rs_seq_masked_fraction"]
    return names + list(OFFPOLICY_NAMES)
