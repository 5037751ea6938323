"""Chat templates: read from where a model keeps one, rendered with jinja2 as transformers' apply_chat_template does.

A template is found in a GGUF file's `tokenizer.chat_template` metadata, a Hugging Face folder's
`chat_template.jinja` or `tokenizer_config.json` (`chat_template`: a string, or a list of named templates of which
"default" is taken), or a converted checkpoint folder's `chat_template.jinja`. Rendering uses the environment
transformers builds (sandboxed, trim_blocks and lstrip_blocks, loop controls, `raise_exception`, `strftime_now`,
a `tojson` that keeps non-ASCII text) and hands the template the source's special tokens (`bos_token`,
`eos_token`, ...). The template's end-of-turn marker (e.g. `<|im_end|>`, `<|eot_id|>`) is a stop beside EOS.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Optional

ROLES = ("system", "developer", "user", "assistant", "tool")
MESSAGE_KEYS = ("role", "content", "name")
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|end_of_turn|>",
               "<|END_OF_TURN_TOKEN|>", "<|endoftext|>", "<|end_of_text|>")
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
GGUF_IDS = (("bos_token", "tokenizer.ggml.bos_token_id"), ("eos_token", "tokenizer.ggml.eos_token_id"),
            ("unk_token", "tokenizer.ggml.unknown_token_id"), ("pad_token", "tokenizer.ggml.padding_token_id"))


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template's jinja source, the special tokens it is rendered with (name -> text) and where it came
    from; compiled once, when made (a template jinja cannot parse is a ValueError naming the origin)."""

    source: str
    special_tokens: tuple = ()  # ((name, text), ...), e.g. (("bos_token", "<|begin_of_text|>"),)
    origin: str = "the chat template"
    compiled: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if not isinstance(self.source, str) or not self.source.strip():
            raise ValueError(f"{self.origin}: the chat template is empty")
        object.__setattr__(self, "compiled", _compile(self.source, self.origin))

    @classmethod
    def from_source(cls, path: Optional[str], tokenizer=None) -> Optional["ChatTemplate"]:
        """The template kept at `path` (a .gguf file, a Hugging Face or converted checkpoint folder, or a
        tokenizer.json whose folder holds one), or None when there is none. tokenizer: fills the bos/eos tokens
        a source leaves unnamed (a converted checkpoint's chat_template.jinja names none)."""
        if not path:
            return None
        if os.path.isfile(path) and path.endswith(".gguf"):
            found = _from_gguf(path)
        elif os.path.isdir(path) or os.path.isfile(path):
            found = _from_folder(path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path)))
        else:
            return None
        if found is None:
            return None
        source, special, origin = found
        return cls(source, tuple(sorted({**_tokenizer_special(tokenizer), **special}.items())), origin)

    @property
    def stop_strings(self) -> tuple:
        """The end-of-turn markers the template writes (END_OF_TURN, in that order)."""
        return tuple(s for s in END_OF_TURN if s in self.source)

    def stop_token_ids(self, tokenizer) -> frozenset:
        """Ids of the end-of-turn markers that are one token each in `tokenizer` (the stops beside EOS)."""
        if tokenizer is None:
            return frozenset()
        ids = (tokenizer.encode(s, bos=False) for s in self.stop_strings)
        return frozenset(i[0] for i in ids if len(i) == 1)

    def render(self, messages: list, add_generation_prompt: bool = True) -> str:
        """The conversation as the prompt text the model was trained on (checked first: check_messages)."""
        import jinja2
        chat = check_messages(messages)
        try:
            return self.compiled.render(messages=chat, tools=None, documents=None,
                                        add_generation_prompt=add_generation_prompt, **dict(self.special_tokens))
        except jinja2.TemplateError as e:
            raise ValueError(f"messages: {self.origin} refuses them: {_first_line(e)}") from None


def check_messages(messages) -> list:
    """A conversation's messages as plain dicts (role, content as a string, name when given); ValueError naming
    the message and the field. Content given as parts keeps their texts joined by newlines (vLLM's way)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages: give a non-empty list of {\"role\": ..., \"content\": ...} objects")
    return [_message(m, i) for i, m in enumerate(messages)]


def _message(m, i: int) -> dict:
    if not isinstance(m, dict):
        raise ValueError(f"messages[{i}]: give an object with role and content")
    unknown = sorted(set(m) - set(MESSAGE_KEYS))
    if unknown:
        raise ValueError(f"messages[{i}]: {unknown[0]}: unknown field (fields: {', '.join(MESSAGE_KEYS)})")
    role = m.get("role")
    if role not in ROLES:
        raise ValueError(f"messages[{i}]: role {role!r}: give one of {', '.join(ROLES)}")
    if "name" in m and not isinstance(m["name"], str):
        raise ValueError(f"messages[{i}]: name: give a string")
    out = {"role": role, "content": _content(m.get("content"), i)}
    return {**out, "name": m["name"]} if "name" in m else out


def _content(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        bad = [p for p in content if not (isinstance(p, dict) and p.get("type") == "text"
                                          and isinstance(p.get("text"), str) and set(p) == {"type", "text"})]
        if not bad:
            return "\n".join(p["text"] for p in content)
    raise ValueError(f"messages[{i}]: content: give a string or a list of {{\"type\": \"text\", \"text\": ...}} "
                     "parts (only text is read)")


def _compile(source: str, origin: str):
    """The template compiled in transformers' environment (chat_template_utils._compile_jinja_template)."""
    try:
        import jinja2
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ValueError("chat templates need the jinja2 package: pip install jinja2") from None

    class Generation(Extension):  # {% generation %}...{% endgeneration %}: transformers marks training spans
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{origin}: the chat template is not valid jinja (line {e.lineno}: {e.message})") from None


def _raise_exception(message):
    import jinja2
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _from_gguf(path: str) -> Optional[tuple]:
    """(template, special tokens, origin) from a GGUF's metadata, or None when it holds no template."""
    try:
        import gguf
        reader = gguf.GGUFReader(path)
    except ImportError:
        raise ValueError("reading a chat template from a .gguf file needs the gguf package: pip install gguf") from None
    except Exception as e:  # the reader raises several kinds on bad files
        raise ValueError(f"{path} is not a readable GGUF file: {_first_line(e)}") from None
    field_ = reader.fields.get("tokenizer.chat_template")
    if field_ is None:
        return None
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    special = {}
    for name, key in GGUF_IDS:
        f = reader.fields.get(key)
        if f is not None and tokens is not None and 0 <= int(f.contents()) < len(tokens.data):
            special[name] = tokens.contents(int(f.contents()))
    return str(field_.contents()), special, f"{path} (tokenizer.chat_template)"


def _from_folder(folder: str) -> Optional[tuple]:
    """(template, special tokens, origin) from tokenizer_config.json or chat_template.jinja in `folder`."""
    config = _read_json(os.path.join(folder, "tokenizer_config.json"))
    special = {k: _token_text(config[k]) for k in SPECIAL_NAMES if _token_text(config.get(k))}
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja):  # before tokenizer_config.json's, as transformers takes it
        with open(jinja, encoding="utf-8") as f:
            return f.read(), special, jinja
    template = _config_template(config, folder)
    return None if template is None else (template, special, f"{folder}/tokenizer_config.json (chat_template)")


def _config_template(config: dict, folder: str) -> Optional[str]:
    """tokenizer_config.json's chat_template: a string, or the one named "default" of a list of named ones."""
    t = config.get("chat_template")
    if t is None or isinstance(t, str):
        return t
    named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)} if isinstance(t, list) else {}
    if isinstance(named.get("default"), str):
        return named["default"]
    raise ValueError(f"{folder}/tokenizer_config.json: chat_template is neither a string nor a list of named "
                     "templates holding one named \"default\"")


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not readable JSON: {_first_line(e)}") from None
    return data if isinstance(data, dict) else {}


def _token_text(value) -> Optional[str]:
    """A special token as tokenizer_config.json gives it: its text, or an AddedToken's {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _tokenizer_special(tokenizer) -> dict:
    """bos_token / eos_token texts from a flexh2o Tokenizer's ids (none without one)."""
    if tokenizer is None:
        return {}
    out = {}
    for name, tid in (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id)):
        text = tokenizer.backend.id_to_token(tid) if tid is not None else None
        if text:
            out[name] = text
    return out
