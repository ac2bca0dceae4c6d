"""Chat templates: message lists rendered with the model's own Jinja ``chat_template``.

A model directory's ``tokenizer_config.json`` may hold ``chat_template`` (a string, or a
list of ``{"name", "template"}`` of which ``"default"`` is used; newer checkpoints put it in
``chat_template.jinja`` beside it). :func:`render_chat` renders it as transformers'
``apply_chat_template(..., tokenize=False)`` does: a sandboxed ``jinja2`` environment with
``trim_blocks`` / ``lstrip_blocks`` and the ``loopcontrols`` extension, the globals
``raise_exception`` and ``strftime_now``, a ``tojson`` filter that does not escape HTML,
and the template variables ``messages``, ``add_generation_prompt``, ``tools``,
``documents`` and every special token string (``bos_token``, ``eos_token``, ...). The
rendered text already holds the special tokens the template writes (a Llama 3 BOS, ...),
so it is tokenised without the tokenizer's own post-processor
(``Tokenizer.encode(text, add_special_tokens=False)``), as transformers does.
"""
from __future__ import annotations

import functools
import json
import os
from datetime import datetime
from typing import Dict, List, Mapping, Optional, Sequence

__all__ = ["load_chat_template", "render_chat", "check_messages"]


def load_chat_template(model_path: str, tokenizer_config: Optional[dict] = None) -> Optional[str]:
    """The model directory's chat template, or None when it has none."""
    tc = tokenizer_config or {}
    tpl = tc.get("chat_template")
    if isinstance(tpl, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default")
    if tpl is None:
        path = os.path.join(model_path, "chat_template.jinja")
        if os.path.isfile(path):
            with open(path) as f:
                tpl = f.read()
    if tpl is not None and not isinstance(tpl, str):
        raise ValueError(f"{model_path}: tokenizer_config.json's chat_template must be a string, "
                         f"got {type(tpl).__name__}")
    return tpl


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes <, > and & for HTML, which would corrupt special tokens.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _text(content, where: str) -> str:
    """A message's content as text: a str, or a list of ``{"type": "text", "text": str}`` parts
    (verl / transformers' form) concatenated, as multimodal chat templates render them."""
    if isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        raise ValueError(f"{where} must be a str or a list of {{'type': 'text', 'text': str}} parts, "
                         f"got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, Mapping) and part.get("type") not in (None, "text"):
            raise ValueError(f"{where}[{j}] is a {part.get('type')!r} part: only text parts are supported")
        if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"{where}[{j}] must be a {{'type': 'text', 'text': str}} part, got {part!r}")
        texts.append(part["text"])
    return "".join(texts)


def check_messages(messages, where: str = "messages") -> List[Dict[str, str]]:
    """``messages`` as a list of ``{"role": str, "content": str, ...}`` dicts, or a ValueError naming
    ``where`` and the message. A content that is a list of text parts becomes their concatenated text;
    any other part (an image, ...) or content (None, a number) is an error, never its ``str()``."""
    if isinstance(messages, (list, tuple)) and not messages:
        raise ValueError(f"{where} is an empty message list; a chat prompt needs at least one message")
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"{where} must be a non-empty list of {{'role', 'content'}} messages, "
                         f"got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "content" not in m:
            raise ValueError(f"{where}[{i}] must be a {{'role', 'content'}} message, got {type(m).__name__}"
                             + (f" with keys {sorted(m)}" if isinstance(m, Mapping) else ""))
        if not isinstance(m.get("role"), str):
            raise ValueError(f"{where}[{i}]['role'] must be a str, got {type(m.get('role')).__name__}")
        out.append({**m, "content": _text(m["content"], f"{where}[{i}]['content']")})
    return out


def render_chat(template: str, messages: Sequence[Mapping], add_generation_prompt: bool = True,
                special_tokens: Optional[Mapping[str, str]] = None, **kwargs) -> str:
    """``template`` rendered for ``messages`` (transformers' ``apply_chat_template`` text).

    ``special_tokens``: ``{"bos_token": "<s>", "eos_token": ...}`` exposed to the template;
    ``kwargs`` (``tools``, ``documents``, ...) too. A template's ``raise_exception`` raises
    ``jinja2.TemplateError``.
    """
    if not isinstance(template, str) or not template:
        raise TypeError(f"template must be a non-empty str, got {type(template).__name__}")
    msgs = check_messages(messages)
    ctx = {"tools": None, "documents": None, **dict(special_tokens or {}), **kwargs}
    return _compile(template).render(messages=msgs, add_generation_prompt=bool(add_generation_prompt), **ctx)
