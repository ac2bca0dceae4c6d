"""Chat templates rendered by dapo_trainer.chat equal transformers' apply_chat_template, text and
token ids, for three real templates (Llama 3, Qwen2.5, ChatML as vLLM ships it; tests/trainer/data)."""
import json
import os
import random

import pytest

from dapo_trainer.chat import render_chat
from dapo_trainer.data import load_tokenizer

HERE = os.path.join(os.path.dirname(__file__), "data", "chat_templates")
TEMPLATES = {"llama3": ("<|begin_of_text|>", "<|eot_id|>", ["<|start_header_id|>", "<|end_header_id|>"]),
             "qwen2_5": (None, "<|im_end|>", ["<|im_start|>", "<|endoftext|>"]),
             "chatml": (None, "<|im_end|>", ["<|im_start|>"])}
WORDS = ["order", "status", " where", "is", "my", "parcel?", "  padded  ", "naïve", "日本", "id: A17", "\n", "ok."]


def _model_dir(tmp_path, name: str) -> str:
    """A byte-level BPE tokenizer (with a BOS-adding post-processor, which a templated prompt
    must not get twice) and tokenizer_config.json holding the real template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    bos, eos, extra = TEMPLATES[name]
    specials = [t for t in (bos, eos, *extra) if t]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([" ".join(WORDS)] * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    path = str(tmp_path / name)
    os.makedirs(path)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(HERE, f"{name}.jinja")) as f:
        template = f.read()
    tc = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "chat_template": template}
    if bos:
        tc["bos_token"] = bos
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(tc, f)
    return path


def _conversation(rng: random.Random, system: bool, end_with_user: bool):
    def text():
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))

    msgs = [{"role": "system", "content": text()}] if system else []
    for t in range(rng.randint(1, 3)):
        msgs.append({"role": "user", "content": text()})
        msgs.append({"role": "assistant", "content": text()})
    return msgs[:-1] if end_with_user else msgs


def _ids(out):
    return list(out["input_ids"]) if hasattr(out, "keys") else list(out)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_render_equals_transformers(tmp_path, name):
    transformers = pytest.importorskip("transformers", reason="transformers (requirements-dev.txt) is the reference")
    path = _model_dir(tmp_path, name)
    ref = transformers.PreTrainedTokenizerFast.from_pretrained(path)
    ours = load_tokenizer(path)
    assert ours.chat_template is not None and ours.templated
    rng = random.Random(random.randrange(2**31))
    for i in range(12):
        msgs = _conversation(rng, system=i % 2 == 0, end_with_user=i % 3 != 2)
        for gen in (True, False):
            want = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            got = ours.render_chat(msgs, add_generation_prompt=gen)
            assert got == want, (name, msgs, gen)
            # Token ids as transformers tokenises a rendered chat: no second BOS from the post-processor.
            want_ids = _ids(ref.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen))
            assert ours.encode(got, add_special_tokens=False) == want_ids
    if name == "llama3":
        assert got.startswith("<|begin_of_text|>") and not got.startswith("<|begin_of_text|>" * 2)
        assert ours.encode(got)[:2] == [ours.bos_token_id] * 2  # what encoding with special tokens would do


def test_qwen_tools_and_default_system(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers (requirements-dev.txt) is the reference")
    path = _model_dir(tmp_path, "qwen2_5")
    ref = transformers.PreTrainedTokenizerFast.from_pretrained(path)
    ours = load_tokenizer(path)
    tools = [{"type": "function", "function": {"name": "order_status", "description": "Look up <an> order & more",
                                               "parameters": {"type": "object", "properties": {"id": {"type": "string"}}}}}]
    msgs = [{"role": "user", "content": "where is my order?"}]
    want = ref.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    got = render_chat(ours.chat_template, msgs, True, ours.special_tokens, tools=tools)
    assert got == want and "<an> order & more" in got  # tojson does not HTML-escape
    assert ours.render_chat(msgs).startswith("<|im_start|>system\nYou are Qwen")


def test_raise_exception_and_prompt_text(tmp_path):
    import jinja2

    alternating = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                   "{{ raise_exception('roles must alternate') }}{% endif %}[{{ m['role'] }}]{{ m['content'] }}"
                   "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    with pytest.raises(jinja2.TemplateError, match="roles must alternate"):
        render_chat(alternating, [{"role": "assistant", "content": "x"}])
    assert render_chat(alternating, [{"role": "user", "content": "x"}]) == "[user]x[assistant]"
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        render_chat(alternating, [{"role": "user"}])

    path = _model_dir(tmp_path, "chatml")
    tok = load_tokenizer(path)
    # A str prompt is one user message; the prompt template fills it first.
    assert tok.prompt_text("2+2", "Q: {prompt}") == "<|im_start|>user\nQ: 2+2<|im_end|>\n<|im_start|>assistant\n"
    # Opting out (data.apply_chat_template=false) and templateless models keep the plain text.
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert tok.prompt_text(msgs, use_chat_template=False) == "s\nu"
    assert tok.uses_chat() and not tok.uses_chat(False)
    tok.chat_template = None
    assert tok.prompt_text(msgs) == "s\nu" and tok.prompt_text("p", "<{prompt}>") == "<p>" and not tok.templated
    assert not tok.uses_chat(True)
