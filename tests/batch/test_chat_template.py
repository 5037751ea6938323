"""Chat templates (flexh2o/chat.py) against transformers' apply_chat_template, token for token: SmolLM2's template
from the bundled GGUF, Llama 3's from a tokenizer_config.json and a Qwen2.5-style one from a chat_template.jinja,
with system/user/assistant turns and add_generation_prompt on and off. Exact equality: both sides render the same
jinja source and tokenize the same text, so nothing may differ."""
from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("jinja2")
pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from flexh2o.chat import ChatTemplate, check_messages  # noqa: E402
from flexh2o.tokenizer import load_tokenizer  # noqa: E402

LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
          "{% endif %}")
QWEN25 = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant") %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
           "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
CHATS = [
    [{"role": "user", "content": "Hi there, how are you?"}],
    [{"role": "system", "content": "You answer in one word. Ünïcode ok."},
     {"role": "user", "content": "What is 2 + 2?"},
     {"role": "assistant", "content": "  Four.  "},
     {"role": "user", "content": "And 3 + 3?"}],
]


def _bpe_tokenizer(folder: str) -> None:
    """A byte-level BPE tokenizer.json trained on a few sentences, SPECIAL as its special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    text = ["What is two plus two? Four. You are a helpful assistant created by Alibaba Cloud.",
            "system user assistant Hi there how are you? And three plus three answer in one word"]
    tk.train_from_iterator(text * 20, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tk.save(os.path.join(folder, "tokenizer.json"))


@pytest.fixture
def llama3_folder(tmp_path) -> str:
    _bpe_tokenizer(str(tmp_path))
    cfg = {"bos_token": {"__type": "AddedToken", "content": "<|begin_of_text|>", "lstrip": False, "normalized": False,
                         "rstrip": False, "single_word": False, "special": True}, "eos_token": "<|eot_id|>",
           "chat_template": LLAMA3, "tokenizer_class": "PreTrainedTokenizerFast"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def _ours(template: ChatTemplate, tokenizer, chat, gen: bool) -> list:
    return tokenizer.encode(template.render(chat, add_generation_prompt=gen), bos=False)


@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("chat", CHATS, ids=["user", "turns"])
def test_llama3_from_tokenizer_config_equals_transformers(llama3_folder, chat, gen):
    ref = transformers.AutoTokenizer.from_pretrained(llama3_folder)
    template = ChatTemplate.from_source(llama3_folder)
    want = ref.apply_chat_template(chat, add_generation_prompt=gen, tokenize=True, return_dict=False)
    assert _ours(template, load_tokenizer(llama3_folder), chat, gen) == list(want)
    assert template.render(chat, gen).startswith("<|begin_of_text|>")  # bos_token came from the config


@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("chat", CHATS + [CHATS[1] + [{"role": "tool", "content": "{\"x\": 6}"}]],
                         ids=["user", "turns", "tool"])
def test_qwen_from_chat_template_jinja_equals_transformers(tmp_path, chat, gen):
    _bpe_tokenizer(str(tmp_path))
    (tmp_path / "chat_template.jinja").write_text(QWEN25)
    tok = load_tokenizer(str(tmp_path))
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), chat_template=QWEN25)
    want = ref.apply_chat_template(chat, add_generation_prompt=gen, tokenize=True, return_dict=False)
    template = ChatTemplate.from_source(str(tmp_path), tok)
    assert _ours(template, tok, chat, gen) == list(want)
    assert template.stop_strings == ("<|im_end|>",)
    assert template.stop_token_ids(tok) == {tok.backend.token_to_id("<|im_end|>")}


@pytest.fixture(scope="module")
def smollm2():
    """(the GGUF's path, transformers' tokenizer of it), loaded once: transformers converts the GGUF's vocabulary."""
    pytest.importorskip("gguf")
    from flexh2o.eval.common import smollm2_gguf
    try:
        path = smollm2_gguf()
    except ValueError as e:
        pytest.skip(str(e))
    return path, transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.mark.eval
@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("chat", CHATS, ids=["user", "turns"])
def test_smollm2_gguf_template_equals_transformers(smollm2, chat, gen):
    path, ref = smollm2
    want = ref.apply_chat_template(chat, add_generation_prompt=gen, tokenize=True, return_dict=False)
    template = ChatTemplate.from_source(path)
    tok = load_tokenizer(path)
    assert _ours(template, tok, chat, gen) == list(want)
    assert template.stop_token_ids(tok) == {tok.eos_id}  # SmolLM2's <|im_end|> is its EOS


def test_a_list_of_named_templates_takes_default_and_no_template_is_none(tmp_path):
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ messages[0].content }}!"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert ChatTemplate.from_source(str(tmp_path)).render([{"role": "user", "content": "hi"}]) == "hi!"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    assert ChatTemplate.from_source(str(tmp_path)) is None
    assert ChatTemplate.from_source(None) is None


def test_the_template_environment_is_transformers(tmp_path):
    src = ("{% for m in messages %}{% if m.role == 'user' and loop.index0 % 2 %}{{ raise_exception('Roles must "
           "alternate') }}{% endif %}{{ m | tojson }}\n{% endfor %}{{ strftime_now('%Y') | length }}")
    t = ChatTemplate(src)
    chat = [{"role": "system", "content": "é <x>"}]
    assert t.render(chat) == transformers.PreTrainedTokenizerFast(
        tokenizer_object=_tiny_backend(), chat_template=src).apply_chat_template(chat, tokenize=False)
    with pytest.raises(ValueError, match="refuses them: Roles must alternate$"):
        t.render([{"role": "system", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(ValueError, match="not valid jinja"):
        ChatTemplate("{% for %}")


def _tiny_backend():
    from tokenizers import Tokenizer, models
    return Tokenizer(models.WordLevel({"a": 0}, unk_token="a"))


@pytest.mark.parametrize("messages, error", [
    ([], "messages: give a non-empty list"),
    ("hi", "messages: give a non-empty list"),
    ([{"role": "robot", "content": "x"}], r"messages\[0\]: role 'robot': give one of"),
    ([{"role": "user"}], r"messages\[0\]: content: give a string or a list"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], r"only text is read"),
    ([{"role": "user", "content": "x", "tool_calls": []}], r"messages\[0\]: tool_calls: unknown field"),
    (["x"], r"messages\[0\]: give an object"),
])
def test_bad_messages_are_one_line_errors(messages, error):
    with pytest.raises(ValueError, match=error) as e:
        check_messages(messages)
    assert "\n" not in str(e.value)


def test_text_parts_are_joined():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert check_messages([{"role": "user", "content": parts}]) == [{"role": "user", "content": "a\nb"}]
