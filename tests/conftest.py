"""Shared test helpers: tiny configs and Hugging Face reference models built from the engine's own weights."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Every run a test starts without --offload-dir, in this process or a child, puts its disk tier here, never in the
# user's ~/flexh2o_offload (where a killed run of theirs leaves a directory whose sweep adds a line to the stderr the
# tests compare). Set at import, before any test module imports the scripts, whose flags read it once
# (flexh2o/paths.offload_dir).
OFFLOAD_DIR = tempfile.mkdtemp(prefix="flexh2o-offload-")
os.environ["FLEXH2O_OFFLOAD_DIR"] = OFFLOAD_DIR
atexit.register(shutil.rmtree, OFFLOAD_DIR, True)  # each process (xdist's controller and workers) its own folder


def hf_opt(cfg, weights: dict):
    """OPTForCausalLM with the given engine weights (HF state-dict names), fp32, eval mode."""
    from transformers import OPTConfig, OPTForCausalLM
    hc = OPTConfig(vocab_size=cfg.vocab, hidden_size=cfg.hidden, num_hidden_layers=cfg.num_layers,
                   ffn_dim=cfg.ffn, num_attention_heads=cfg.num_heads, max_position_embeddings=cfg.max_positions,
                   word_embed_proj_dim=cfg.embed_dim, do_layer_norm_before=cfg.norm_before,
                   pad_token_id=cfg.pad_token_id, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
                   enable_bias=True, dropout=0.0)
    model = OPTForCausalLM(hc).eval()
    sd = dict(weights)
    sd["lm_head.weight"] = sd["model.decoder.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    return model.float()


def hf_greedy(model, prompt: list, gen_len: int) -> tuple:
    """(tokens, last-step logits) of plain greedy decoding, one unpadded sequence at a time."""
    ids = torch.tensor([prompt])
    tokens = []
    with torch.no_grad():
        for _ in range(gen_len):
            logits = model(ids).logits[0, -1]
            nxt = int(logits.argmax())
            tokens.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return tokens, logits


def ragged_prompts(n: int, max_len: int, vocab: int, seed: int = 0) -> list:
    """n prompts of unequal lengths (the first is max_len long), seeded."""
    g = torch.Generator().manual_seed(seed)
    lens = [max_len] + torch.randint(1, max_len + 1, (n - 1,), generator=g).tolist()
    return [torch.randint(4, vocab, (ln,), generator=g).tolist() for ln in lens]


def _fixture_profiles(cache: str) -> None:
    """`--hardware auto` finds a profile of this machine without measuring one (a minute) in CI: the shipped CPU
    profile's figures under this machine's fingerprint, for the thread counts tests run with; and a fixed dtype
    probe under the same fingerprints (tests that test the probe itself monkeypatch it or use their own dir)."""
    import json
    from flexh2o.planning import machine
    from flexh2o.tuning import profile_cache
    from flexh2o.tuning.hardware import load_profile
    prof = load_profile("cpu_measured")
    for key, by_dtype in list(prof.items()):  # every candidate dtype, so a dry run never measures one (--hardware
        if isinstance(by_dtype, dict) and "bfloat16" in by_dtype:  # auto adds a missing compute dtype's rates)
            prof[key] = {"float16": by_dtype["bfloat16"], **by_dtype}
    fp = machine.fingerprint("cpu")
    from flexh2o.planning import dtype_choice
    for threads in {1, os.cpu_count(), torch.get_num_threads()}:
        here = {**fp, "threads": threads}
        path = os.path.join(cache, profile_cache.profile_file("cpu", here))
        with open(path, "w") as f:
            json.dump({**prof, "name": "test-fixture", "fingerprint": here}, f)
        probe = os.path.join(cache, f"dtype_probe-v{dtype_choice.PROBE_VERSION}-{machine.fingerprint_key(here)}.json")
        with open(probe, "w") as f:  # fixed timings: dtype choices (and their notes) must not follow the load
            json.dump({"version": dtype_choice.PROBE_VERSION, "fingerprint": here, "timings": FIXTURE_PROBE}, f)


# a dtype probe where fp32 is fastest and no pair is 2x slower (so no "note:" line), bf16 decode not worth it
FIXTURE_PROBE = {"decode": {"float32": 0.010, "bfloat16": 0.0125, "float16": 0.015},
                 "prefill": {"float32": 0.002, "bfloat16": 0.0035, "float16": 0.0038},
                 "convert": {f"{a}->{b}": 0.002 for a in ("float32", "bfloat16", "float16")
                             for b in ("float32", "bfloat16", "float16") if a != b and "float32" in (a, b)}}


@pytest.fixture(scope="session", autouse=True)
def flexh2o_cache(tmp_path_factory):
    """Every test (and every process it starts) caches dtype probes and hardware profiles in a temporary dir,
    never in the user's ~/.cache/flexh2o."""
    before = os.environ.get("FLEXH2O_CACHE_DIR")
    path = tmp_path_factory.mktemp("flexh2o-cache")
    os.environ["FLEXH2O_CACHE_DIR"] = str(path)
    _fixture_profiles(path)
    yield path
    if before is None:
        os.environ.pop("FLEXH2O_CACHE_DIR", None)
    else:
        os.environ["FLEXH2O_CACHE_DIR"] = before


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread avoids OpenMP spin-waiting, several times faster on a shared 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def offload_dir(tmp_path):
    d = tmp_path / "offload"
    yield str(d)
    leftovers = [p for p in d.glob("*")] if d.exists() else []
    assert not leftovers, f"offload files left behind: {leftovers}"
