"""What a run needs beside the weights, kept in the converted checkpoint so that `--path CKPT` alone is enough:
tokenizer.json (copied from a Hugging Face folder, or built from a GGUF's tokenizer metadata by flexh2o.tokenizer),
generation_config.json (bos/eos ids and whether a BOS is added, which flexh2o.tokenizer reads beside
tokenizer.json), a folder's tokenizer_config.json (the special tokens' texts) and the chat template as
chat_template.jinja (a GGUF's `tokenizer.chat_template`, a folder's
chat_template.jinja or its tokenizer_config.json `chat_template`)."""
from __future__ import annotations

import json
import os
import shutil
from typing import Optional

TOKENIZER_FILE = "tokenizer.json"
GENERATION_FILE = "generation_config.json"
TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
IDS = ("bos_token_id", "eos_token_id")


def write_run_files(src: str, dst: str) -> list:
    """Write what `src` (a .gguf file or a Hugging Face folder) holds of the above into the folder `dst`; -> the
    names of what was kept (a source without a tokenizer keeps none, and says so by an empty list)."""
    tokenizer, ids, template = _from_gguf(src) if src.endswith(".gguf") else _from_folder(src)
    kept = []
    if tokenizer is not None:
        tokenizer(os.path.join(dst, TOKENIZER_FILE))
        kept.append(TOKENIZER_FILE)
    if ids:
        _write(os.path.join(dst, GENERATION_FILE), json.dumps(ids, indent=1))
        kept.append("eos id " + str(ids.get("eos_token_id")))
    if template:
        _write(os.path.join(dst, TEMPLATE_FILE), template)
        kept.append(TEMPLATE_FILE)
    config = os.path.join(src, CONFIG_FILE)
    if os.path.isdir(src) and os.path.isfile(config):  # the special tokens' texts a chat template names (chat.py)
        shutil.copyfile(config, os.path.join(dst, CONFIG_FILE))
    return kept


def _from_gguf(src: str) -> tuple:
    """(writer of tokenizer.json or None, ids, chat template or None) of a GGUF file."""
    import gguf
    from flexh2o.tokenizer import from_gguf
    fields = gguf.GGUFReader(src).fields

    def get(key: str):
        return fields[key].contents() if key in fields else None
    template = get("tokenizer.chat_template")
    ids = {k: int(get(f"tokenizer.ggml.{k}")) for k in IDS if get(f"tokenizer.ggml.{k}") is not None}
    if "tokenizer.ggml.model" not in fields:
        return None, ids, template
    try:
        tok = from_gguf(src)
    except ValueError:  # a vocabulary flexh2o cannot build here (transformers missing): the weights still convert
        return None, ids, template
    return (lambda path: tok.backend.save(path)), {**ids, "add_bos_token": tok.add_bos}, template


def _from_folder(src: str) -> tuple:
    """(copier of tokenizer.json or None, ids, chat template or None) of a Hugging Face folder."""
    tj = os.path.join(src, TOKENIZER_FILE)
    ids: dict = {}
    for name in ("config.json", GENERATION_FILE):  # the later file wins, as transformers' generation does
        d = _json(os.path.join(src, name))
        ids.update({k: d[k] for k in IDS if d.get(k) is not None})
    copy = (lambda path: shutil.copyfile(tj, path)) if os.path.isfile(tj) else None
    return copy, ids, _folder_template(src)


def _folder_template(src: str) -> Optional[str]:
    """chat_template.jinja, else tokenizer_config.json's chat_template (a string, or a list of named templates:
    the one named 'default')."""
    jinja = os.path.join(src, TEMPLATE_FILE)
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as fh:
            return fh.read()
    t = _json(os.path.join(src, CONFIG_FILE)).get("chat_template")
    if isinstance(t, list):
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
    return t if isinstance(t, str) and t else None


def _json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            d = json.load(fh)
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
