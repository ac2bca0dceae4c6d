"""Multi-turn rollout: model turns sampled by any engine, environment turns in between.

``multi_turn_rollout(engine, tokenizer, env, rows, n, ...)`` opens every conversation with
``env.reset(row)`` (rendered with the model's chat template when it has one), samples the
first assistant turn of the ``n`` conversations of each row together (one prefill per row),
then alternates: ``env.step(history)`` for every conversation whose turn ended, and one
``engine.generate`` call over all live conversations' contexts, until the environment ends
the dialogue, ``max_turns`` assistant turns were taken, or the response token budget is
spent. The loop only calls ``engine.generate``, so every engine (embedded, vLLM) runs it.

The *response* of a conversation is everything after its prompt, the turns laid end to end;
``response_mask`` marks the tokens the model sampled, and the environment's tokens (its
messages and the template's glue around them) are context only: no loss, no entropy, no KL.

Environment tokens: with a chat template, the text the template writes between the end of
the assistant's sampled turn and the start of the next one (closing of the assistant turn,
the environment's message, the next generation prompt); without one, the message's content.

Budget: ``max_response_length`` tokens of response per conversation (assistant and
environment tokens); ``max_turn_tokens`` caps one assistant turn. A turn that hits either
cap, or an environment message that does not leave room for one more sampled token, ends the
conversation with finish reason "length".
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from ..envs import EnvironmentError_, check_step_result
from ..chat import check_messages
from .base import FINISH_LENGTH, FINISH_STOP
from .embedded import request_keys

__all__ = ["Conversation", "MultiTurnOutput", "multi_turn_rollout"]
FINISH_ERROR = "error"


@dataclass
class Conversation:
    """One dialogue: its messages and its response tokens (turns end to end)."""

    messages: List[Dict[str, str]]
    prompt_len: int
    tokens: List[int] = field(default_factory=list)
    mask: List[bool] = field(default_factory=list)       # True: sampled by the model
    log_probs: List[float] = field(default_factory=list)  # 0 for environment tokens
    turn_lengths: List[tuple] = field(default_factory=list)  # ("assistant" | "env", tokens)
    components: Dict[str, float] = field(default_factory=dict)
    finish: Optional[str] = None  # None while live
    error: Optional[str] = None
    text: str = ""  # the rendered context so far (chat template), to cut the next environment turn from

    @property
    def num_turns(self) -> int:
        return sum(1 for role, _ in self.turn_lengths if role == "assistant")


@dataclass
class MultiTurnOutput:
    """``N = len(rows) * n`` conversations, laid out like :class:`~.base.RolloutOutput`
    (``response_ids``, ``cu_seqlens``, ``lengths``, ``log_probs``, ``finish_reasons``,
    ``group_index``, ``n``, ``prompt_ids``) plus ``response_mask`` ``[T]`` bool and the
    conversations themselves."""

    conversations: List[Conversation]
    prompt_ids: List[List[int]]
    n: int
    response_ids: torch.Tensor = None
    response_mask: torch.Tensor = None
    log_probs: torch.Tensor = None
    cu_seqlens: torch.Tensor = None
    lengths: torch.Tensor = None
    group_index: torch.Tensor = None
    finish_reasons: List[str] = None

    def __post_init__(self):
        convs = self.conversations
        self.lengths = torch.tensor([len(c.tokens) for c in convs], dtype=torch.int64)
        self.cu_seqlens = torch.zeros(len(convs) + 1, dtype=torch.int32)
        self.cu_seqlens[1:] = self.lengths.cumsum(0)
        self.response_ids = torch.tensor([t for c in convs for t in c.tokens], dtype=torch.int64)
        self.response_mask = torch.tensor([m for c in convs for m in c.mask], dtype=torch.bool)
        self.log_probs = torch.tensor([x for c in convs for x in c.log_probs], dtype=torch.float32)
        self.group_index = torch.arange(len(self.prompt_ids), dtype=torch.int64).repeat_interleave(self.n)
        self.finish_reasons = [c.finish or FINISH_STOP for c in convs]

    @property
    def num_responses(self) -> int:
        return len(self.conversations)

    def response(self, k: int) -> List[int]:
        return list(self.conversations[k].tokens)

    @property
    def errors(self) -> Dict[int, str]:
        """``{conversation index: what went wrong}`` of the conversations an environment failed on."""
        return {k: c.error for k, c in enumerate(self.conversations) if c.error is not None}

    def turn_stats(self) -> Dict[str, float]:
        """Per-turn statistics: turns per dialogue, tokens per assistant / environment turn,
        assistant vs environment tokens."""
        convs = self.conversations
        a_turns = [n for c in convs for r, n in c.turn_lengths if r == "assistant"]
        e_turns = [n for c in convs for r, n in c.turn_lengths if r == "env"]
        a_tok, e_tok = sum(a_turns), sum(e_turns)
        N = max(len(convs), 1)
        return {"dialog/turns_per_dialog": sum(c.num_turns for c in convs) / N,
                "dialog/max_turns_per_dialog": float(max((c.num_turns for c in convs), default=0)),
                "dialog/tokens_per_assistant_turn": a_tok / max(len(a_turns), 1),
                "dialog/tokens_per_env_turn": e_tok / max(len(e_turns), 1),
                "dialog/assistant_tokens": float(a_tok), "dialog/env_tokens": float(e_tok),
                "dialog/assistant_token_fraction": a_tok / max(a_tok + e_tok, 1),
                "dialog/truncated": sum(c.finish == FINISH_LENGTH for c in convs) / N,
                "dialog/env_errors": float(sum(c.error is not None for c in convs))}


def _env_name(env) -> str:
    return getattr(env, "name", None) or type(env).__qualname__


def _fail(conv: Conversation, env, k: int, n: int, what: str) -> None:
    conv.finish, conv.error = FINISH_ERROR, (
        f"environment {_env_name(env)!r} failed on conversation {k} (row {k // n}, sample {k % n}, "
        f"after {conv.num_turns} assistant turns): {what}")


def _calls(live: List[int], ctx_len: Dict[int, int], caps: Dict[int, int], limit: int):
    """Group live conversations into generate calls ``(members, max_new)`` with
    ``context + max_new <= limit`` for every member (each fits its own cap by construction)."""
    calls = []
    for k in sorted(live, key=lambda k: -caps[k]):
        if calls and ctx_len[k] + calls[-1][1] <= limit:
            calls[-1][0].append(k)
        else:
            calls.append(([k], caps[k]))
    return calls


def multi_turn_rollout(engine, tokenizer, env, rows: Sequence[dict], n: int, *, max_prompt_length: int,
                       max_response_length: int, max_turns: int, max_turn_tokens: Optional[int] = None,
                       temperature: float = 1.0, top_p: float = 1.0, seed: int = 0, use_chat_template: bool = True,
                       truncation: str = "error", on_error: str = "raise") -> MultiTurnOutput:
    """Roll out ``n`` dialogues per row (module docstring).

    Args:
        engine: a rollout engine (``generate(prompt_ids, n, max_new_tokens, ...)``).
        tokenizer: :class:`dapo_trainer.data.Tokenizer` (stop tokens, chat template, decode).
        env: the environment (:mod:`dapo_trainer.envs`).
        on_error: "raise": after every other conversation has finished, raise
            :class:`~dapo_trainer.envs.EnvironmentError_` naming the environment and the failed
            conversations, with the whole rollout as ``.output``; "drop": return, the failed
            conversations flagged (``output.errors``, finish reason "error").
    """
    from ..data import encode_prompt

    if on_error not in ("raise", "drop"):
        raise ValueError(f"on_error must be 'raise' or 'drop', got {on_error!r}")
    chat = tokenizer.uses_chat(use_chat_template)
    step = _stepper(env)
    stops = tuple(tokenizer.eos_token_ids)
    limit = getattr(engine, "max_model_len", None) or max_prompt_length + max_response_length
    convs: List[Conversation] = []
    prompt_ids: List[List[int]] = []
    opening_errors: Dict[int, str] = {}
    for b, row in enumerate(rows):
        try:
            msgs = check_messages(env.reset(row), "reset()'s messages")
        except Exception as e:  # the row's n conversations fail; the other rows go on
            msgs, opening_errors[b] = [{"role": "user", "content": ""}], f"reset() raised {e!r}"
        text = tokenizer.prompt_text(msgs, "{prompt}", use_chat_template)
        ids = encode_prompt(tokenizer, text, max_prompt_length, truncation, add_special_tokens=not chat) or \
            [tokenizer.pad_token_id]
        prompt_ids.append(ids)
        for _ in range(n):
            convs.append(Conversation(messages=[dict(m) for m in msgs], prompt_len=len(ids), text=text))
    for k, c in enumerate(convs):
        if k // n in opening_errors:
            _fail(c, env, k, n, opening_errors[k // n])

    for turn in range(max_turns):
        live = [k for k, c in enumerate(convs) if c.finish is None]
        if not live:
            break
        caps = {k: min(max_turn_tokens or max_response_length, max_response_length - len(convs[k].tokens))
                for k in live}
        ctx_len = {k: convs[k].prompt_len + len(convs[k].tokens) for k in live}
        if turn == 0:  # every conversation of a row shares its prompt: one prefill per row
            rows_live = sorted({k // n for k in live})
            cap = max(caps[k] for k in live)
            out = engine.generate([prompt_ids[b] for b in rows_live], n, cap, temperature=temperature, top_p=top_p,
                                  seed=seed, stop_token_ids=stops)
            sampled = {}
            for j, b in enumerate(rows_live):
                for i in range(n):
                    if b * n + i in caps:
                        sampled[b * n + i] = (out, j * n + i)
        else:
            sampled = {}
            for ci, (members, cap) in enumerate(_calls(live, ctx_len, caps, limit)):
                ctx = [prompt_ids[k // n] + convs[k].tokens for k in members]
                out = engine.generate(ctx, 1, cap, temperature=temperature, top_p=top_p,
                                      seed=int(request_keys(seed, turn * 1024 + ci + 1)[-1]), stop_token_ids=stops)
                sampled.update({k: (out, i) for i, k in enumerate(members)})
        for k in live:
            out, i = sampled[k]
            c = convs[k]
            s, e = int(out.cu_seqlens[i]), int(out.cu_seqlens[i + 1])
            ids, lps = out.response_ids[s:e].tolist()[:caps[k]], out.log_probs[s:e].tolist()[:caps[k]]
            stopped = bool(ids) and ids[-1] in stops
            c.tokens += ids
            c.mask += [True] * len(ids)
            c.log_probs += lps
            c.turn_lengths.append(("assistant", len(ids)))
            content = tokenizer.decode(ids[:-1] if stopped else ids)
            c.messages.append({"role": "assistant", "content": content})
            if chat:
                c.text += tokenizer.tok.decode(ids, skip_special_tokens=False)
            if not stopped:
                c.finish = FINISH_LENGTH
        # The environment answers (and scores) every conversation whose turn just ended.
        for k in live:
            c = convs[k]
            try:
                res = step([dict(m) for m in c.messages], rows[k // n])
            except Exception as e:
                _fail(c, env, k, n, f"step() raised {e!r}")
                continue
            try:
                msg, comps = check_step_result(res)
            except (TypeError, ValueError) as e:
                _fail(c, env, k, n, str(e))
                continue
            for name, v in comps.items():
                c.components[name] = c.components.get(name, 0.0) + v
            if c.finish is not None:
                continue
            if msg is None or turn + 1 == max_turns:
                c.finish = FINISH_STOP
                continue
            env_text = _env_text(tokenizer, c, msg) if chat else msg["content"]
            env_ids = tokenizer.encode(env_text, add_special_tokens=False)
            c.messages.append(msg)
            if not env_ids:
                _fail(c, env, k, n, f"step()'s message {msg!r} encodes to no tokens")
                continue
            if len(c.tokens) + len(env_ids) >= max_response_length:
                c.finish = FINISH_LENGTH  # no room for the environment's turn and one more sampled token
                continue
            c.tokens += env_ids
            c.mask += [False] * len(env_ids)
            c.log_probs += [0.0] * len(env_ids)
            c.turn_lengths.append(("env", len(env_ids)))
            c.text += env_text
    for c in convs:
        c.finish = c.finish or FINISH_STOP
    result = MultiTurnOutput(convs, prompt_ids, n)
    if result.errors and on_error == "raise":
        errs = result.errors
        shown = "; ".join(errs[k] for k in list(errs)[:3])
        raise EnvironmentError_(f"{len(errs)} of {len(convs)} conversations failed (the others completed; "
                                f"their samples are in this error's .output): {shown}", output=result)
    return result


def _stepper(env):
    """``env.step`` as ``f(history, row)``: environments whose ``step`` takes a second parameter get
    the conversation's data row (hidden facts such as the answer), the others the history only."""
    import inspect

    try:
        takes_row = len(inspect.signature(env.step).parameters) >= 2
    except (TypeError, ValueError):
        takes_row = False
    return env.step if takes_row else (lambda history, row: env.step(history))


def _env_text(tokenizer, conv: Conversation, msg: Dict[str, str]) -> str:
    """What the chat template writes after the assistant's sampled turn up to the next
    generation prompt, around the environment's message ``msg``."""
    full = tokenizer.render_chat(conv.messages + [msg], add_generation_prompt=True)
    if full.startswith(conv.text):
        return full[len(conv.text):]
    # The sampled text does not re-render verbatim (the template trims it, say): the delta of
    # the renderings with and without the message.
    base = tokenizer.render_chat(conv.messages, add_generation_prompt=False)
    if not full.startswith(base):
        raise ValueError("the chat template renders a conversation differently once a message is appended; "
                         "multi-turn rollouts need a prefix-stable template")
    return full[len(base):]
