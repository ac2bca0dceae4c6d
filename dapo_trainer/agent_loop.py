"""How a generation batch's prompts become rewarded responses: one engine call (single-turn) or
dialogues with an environment (multi-turn), two implementations of :class:`AgentLoop`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple

from . import data as data_mod
from . import rewards
from .rewards import dialogue
from .rollout.multiturn import multi_turn_rollout

# (scores, accs, reward components) of every response, in the rollout's order.
Scores = Tuple[List[float], List[float], List[dict]]


@dataclass
class Episodes:
    """One rollout's responses as the engine laid them out (``out``: ``response_ids`` /
    ``log_probs`` ``[T]``, ``lengths``, ``group_index``, ``finish_reasons``; multi-turn:
    ``response_mask``, ``errors``), the prompt ids of each group, assistant turns per response."""

    out: object
    prompts: List[List[int]]
    turns: List[int]
    turn_stats: Dict[str, float]  # multi-turn: per-turn statistics, else empty


class AgentLoop(Protocol):
    def run(self, *, rows: Sequence[dict], keys: Sequence[int], cache: Optional[dict], n: int, temperature: float,
            top_p: float, seed: int, prompt_offset: int) -> Episodes:
        """``n`` responses to each of ``rows`` (``keys``: their indices in the data, the prompt
        cache's keys; ``prompt_offset``: the first row's index in the whole generation batch)."""

    def score(self, episodes: Episodes, rows: Sequence[dict]) -> Scores:
        """Rewards of every response of ``episodes``."""


class SingleTurnLoop:
    """One engine call: a response is one assistant turn, rewarded by ``reward_fn`` on its text."""

    def __init__(self, cfg, tokenizer, engine, reward_fn: Callable):
        self.data_cfg, self.tokenizer, self.engine, self.reward_fn = cfg.data, tokenizer, engine, reward_fn

    def prompt_ids(self, rows: Sequence[dict], keys: Sequence[int], cache: Optional[dict]) -> List[List[int]]:
        """Templated, tokenised, length-checked prompts of ``rows`` (memoised in ``cache`` by ``keys``)."""
        cache = {} if cache is None else cache
        for row, i in zip(rows, keys):
            if i not in cache:
                cache[i] = data_mod.row_prompt_ids(self.tokenizer, row["prompt"], self.data_cfg)
        return [cache[i] for i in keys]

    def run(self, *, rows, keys, cache, n, temperature, top_p, seed, prompt_offset) -> Episodes:
        prompts = self.prompt_ids(rows, keys, cache)
        out = self.engine.generate(prompts, n, self.data_cfg.max_response_length, temperature=temperature,
                                   top_p=top_p, seed=seed, stop_token_ids=self.tokenizer.eos_token_ids,
                                   prompt_offset=prompt_offset)
        return Episodes(out, prompts, [1] * out.num_responses, {})

    def score(self, episodes: Episodes, rows: Sequence[dict]) -> Scores:
        out, max_len = episodes.out, self.data_cfg.max_response_length
        stops = set(self.tokenizer.eos_token_ids)
        scores, accs, comps = [], [], []
        for k in range(out.num_responses):
            ids = out.response(k)
            truncated = not ids or ids[-1] not in stops
            body = ids if truncated else ids[:-1]
            row_index = out.group_index[k].item()
            row = rows[row_index]
            # verl's reward managers pass the row's extra_info with the per-response keys merged in.
            extra = {**row.get("extra_info", {}), "prompt": row["prompt"], "response_length": len(ids),
                     "max_response_length": max_len, "truncated": truncated}
            score, res = rewards.check_reward(
                self.reward_fn(row["data_source"], self.tokenizer.decode(body), row["ground_truth"], extra),
                fn_name=getattr(self.reward_fn, "__name__", repr(self.reward_fn)), sample_index=k,
                row_index=row_index)
            scores.append(score)
            accs.append(float(res["acc"]) if "acc" in res else float(score > 0))
            comps.append(res)
        return scores, accs, comps


class MultiTurnLoop:
    """Dialogues with an environment (``rollout.multiturn``), rewarded by ``dialogue.score_dialogues``."""

    def __init__(self, cfg, tokenizer, engine, env, reward_fn: Optional[Callable]):
        self.cfg, self.tokenizer, self.engine, self.env, self.reward_fn = cfg, tokenizer, engine, env, reward_fn
        self.scorers = {}
        if cfg.reward_model.dialogue.scorers:
            from .rewards.scorers import build_scorers

            self.scorers = build_scorers(cfg.reward_model.dialogue)

    def run(self, *, rows, keys, cache, n, temperature, top_p, seed, prompt_offset) -> Episodes:
        d, ec = self.cfg.data, self.cfg.environment
        out = multi_turn_rollout(self.engine, self.tokenizer, self.env, rows, n, max_prompt_length=d.max_prompt_length,
                                 max_response_length=d.max_response_length, max_turns=ec.max_turns,
                                 max_turn_tokens=ec.max_turn_tokens, temperature=temperature, top_p=top_p, seed=seed,
                                 use_chat_template=d.apply_chat_template, truncation=d.truncation,
                                 on_error=ec.on_error)
        return Episodes(out, out.prompt_ids, [c.num_turns for c in out.conversations], out.turn_stats())

    def score(self, episodes: Episodes, rows: Sequence[dict]) -> Scores:
        return dialogue.score_dialogues(episodes.out, rows, reward_fn=self.reward_fn,
                                        weights=self.cfg.reward_model.dialogue.weights, scorers=self.scorers,
                                        max_response_length=self.cfg.data.max_response_length)


def build_agent_loop(cfg, tokenizer, engine, env=None) -> AgentLoop:
    """The run's loop: multi-turn with an environment (``environment.path``), else single-turn."""
    crf = cfg.custom_reward_function
    custom = rewards.load_reward_fn(crf.path, crf.name) if crf.path else None
    if env is not None:
        return MultiTurnLoop(cfg, tokenizer, engine, env, custom)
    return SingleTurnLoop(cfg, tokenizer, engine, custom or rewards.default_compute_score)
