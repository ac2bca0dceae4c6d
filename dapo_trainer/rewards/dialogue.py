"""Dialogue rewards: a score plus named components per conversation.

A conversation's components are the environment's (summed over its steps) plus those of
the configured scorers (``reward_model.dialogue.scorers``), e.g. ``relevance`` and
``coherence`` (:mod:`dapo_trainer.rewards.scorers`), each computed for a whole generation batch at
once. Its score is, in order of precedence:

1. the custom reward function's (``custom_reward_function``), called as
   ``fn(data_source, last assistant message, ground_truth, extra_info)`` with
   ``extra_info["messages"]`` (the whole conversation) and ``extra_info["components"]``;
   a dict return adds its entries to the components;
2. ``sum(w * component)`` over ``reward_model.dialogue.weights`` when set;
3. the ``score`` component, else the sum of all components.

``acc`` is the ``acc`` component when there is one, else ``score > 0``.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Mapping, Optional, Sequence

from . import check_reward

__all__ = ["score_dialogues"]


def score_dialogues(out, rows: Sequence[dict], *, reward_fn: Optional[Callable] = None,
                    weights: Optional[Mapping[str, float]] = None, scorers: Mapping[str, Callable] = (),
                    max_response_length: int = 0):
    """``(scores, accs, components)`` lists of the ``out.num_responses`` conversations of a
    :class:`~dapo_trainer.rollout.multiturn.MultiTurnOutput` (module docstring). A
    conversation an environment failed on scores 0 (its group is never kept)."""
    convs = out.conversations
    comps: List[Dict[str, float]] = [dict(c.components) for c in convs]
    for name, fn in dict(scorers).items():
        vals = fn([c.messages for c in convs])
        if len(vals) != len(convs):
            raise ValueError(f"scorer {name!r} returned {len(vals)} values for {len(convs)} conversations")
        for cm, v in zip(comps, vals):
            cm[name] = float(v)
    scores, accs = [], []
    for k, (c, cm) in enumerate(zip(convs, comps)):
        if c.error is not None:
            scores.append(0.0)
            accs.append(0.0)
            continue
        row_index = out.group_index[k].item()
        row = rows[row_index]
        if reward_fn is not None:
            last = next((m["content"] for m in reversed(c.messages) if m["role"] == "assistant"), "")
            score, res = check_reward(
                reward_fn(row["data_source"], last, row["ground_truth"],
                          {"messages": c.messages, "components": dict(cm), "extra_info": row.get("extra_info", {}),
                           "response_length": len(c.tokens), "max_response_length": max_response_length,
                           "truncated": c.finish != "stop", "num_turns": c.num_turns}),
                fn_name=getattr(reward_fn, "__name__", repr(reward_fn)), sample_index=k,
                row_index=row_index)
            cm.update({key: v for key, v in res.items() if isinstance(v, float)})
            cm["score"] = score
        elif weights:
            missing = [name for name in weights if name not in cm]
            if missing:
                raise ValueError(f"reward_model.dialogue.weights names {missing}, which neither the environment "
                                 f"nor a scorer returned (components: {sorted(cm)})")
            score = sum(float(w) * cm[name] for name, w in weights.items())
        else:
            score = cm.get("score", sum(cm.values()))
        scores.append(score)
        accs.append(float(cm["acc"]) if "acc" in cm else float(score > 0))
    return scores, accs, comps

