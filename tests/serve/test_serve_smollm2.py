"""flexh2o-serve on the real SmolLM2-135M (the [eval] extra): a chat with its GGUF's own template answered through
the openai client, streamed and not, equals the Python API's LLM.chat of the same conversation (greedy), and stops
at the template's end-of-turn token."""
from __future__ import annotations

import pytest

from serve_helpers import client, live_server

pytestmark = pytest.mark.eval
pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
pytest.importorskip("openai")
pytest.importorskip("fastapi")

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
FLAGS = {"percent": (100, 0, 100, 0), "gpu_batch_size": 2, "prompt_len": 64, "gen_len": 48}


def test_a_smollm2_chat_equals_the_api_and_its_stream(offload_dir):
    from flexh2o import LLM, SamplingParams
    with LLM("smollm2", offload_dir=offload_dir, verbose=0, **FLAGS) as llm:
        want = llm.chat([MESSAGES], SamplingParams(max_tokens=48))[0]
    argv = ["--model", "smollm2", "--offload-dir", offload_dir, "--percent", "100", "0", "100", "0",
            "--gpu-batch-size", "2", "--prompt-len", "64", "--gen-len", "48"]
    with live_server(argv) as (url, _):
        c = client(url, timeout=300)
        whole = c.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=48)
        parts = [ch.delta.content or "" for chunk in c.chat.completions.create(
            model="smollm2", messages=MESSAGES, max_tokens=48, stream=True) for ch in chunk.choices]
    assert whole.choices[0].message.content == want.text and want.text.strip()
    assert "".join(parts) == want.text
    assert whole.choices[0].finish_reason == ("stop" if want.finish_reason in ("eos", "stop") else "length")
    assert whole.usage.completion_tokens == want.generated_tokens
