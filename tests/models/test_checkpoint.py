"""orbax checkpoints: convert a Hugging Face directory, load it, get the very same tokens.

(Restoring into a tensor-parallel mesh is checked on 8 devices in
runtime/test_tensor_parallel.py.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxcb import LLM, SamplingParams
from jaxcb.models.loading.checkpoint import MARKER, is_orbax_checkpoint
from jaxcb.models.loading.checkpoint_convert import convert_hf_checkpoint
from jaxcb.models.loading.default_model import default_model_dir
from jaxcb.models.loading.loader import load_model
from jaxcb.models.weights import ModelLoadError

ROOT = Path(__file__).resolve().parents[2]
ENGINE = dict(max_model_len=128, num_pages=32, max_num_seqs=4, max_num_batched_tokens=32)
ENGINE["token_buckets"] = [16, 32]
PROMPTS = ["Hello, my name is", "The capital of France", "x"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in model converted with the script, as a user would."""
    target = tmp_path_factory.mktemp("orbax") / "tiny"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts/convert_checkpoint.py"),
            str(default_model_dir()),
            str(target),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return target


def tokens(model: Path, **overrides) -> list[list[int]]:
    llm = LLM(str(model), **ENGINE, **overrides)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_layout(converted: Path) -> None:
    assert is_orbax_checkpoint(converted) and not is_orbax_checkpoint(default_model_dir())
    for name in ("config.json", "generation_config.json", "tokenizer.json", MARKER):
        assert (converted / name).is_file(), name
    assert (converted / "params").is_dir()
    assert not list(converted.glob("*.safetensors"))
    assert json.loads((converted / MARKER).read_text())["dtype"] == "float32"


def test_same_params_as_safetensors(converted: Path) -> None:
    hf = load_model(default_model_dir(), tokenizer_path=None, dtype=np.float32)
    orbax = load_model(converted, tokenizer_path=None, dtype=np.float32)
    assert (hf.format, orbax.format) == ("safetensors", "orbax")
    assert hf.eos_token_ids == orbax.eos_token_ids and orbax.tokenizer is not None
    flat_hf = np.concatenate([np.ravel(x) for x in _leaves(hf.params)])
    flat_orbax = np.concatenate([np.ravel(np.asarray(x)) for x in _leaves(orbax.params)])
    np.testing.assert_array_equal(flat_hf, flat_orbax)


def _leaves(tree) -> list:
    import jax

    return jax.tree_util.tree_leaves(tree)


def test_identical_tokens(converted: Path) -> None:
    reference = tokens(default_model_dir())
    assert all(len(set(t)) > 3 for t in reference)  # a diverse reference proves something
    assert tokens(converted) == reference


def test_bfloat16_round_trip(converted: Path, tmp_path: Path) -> None:
    """Stored in bfloat16: loads in bfloat16 exactly as the HF directory does, and an engine
    of another dtype casts while restoring."""
    target = convert_hf_checkpoint(default_model_dir(), tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((target / MARKER).read_text())["dtype"] == "bfloat16"
    assert tokens(target, dtype="bfloat16") == tokens(default_model_dir(), dtype="bfloat16")
    restored = load_model(target, tokenizer_path=None, dtype=np.float32)
    assert restored.params["embed"].dtype == np.float32


def test_mismatched_config_is_a_load_error(converted: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for item in converted.iterdir():
        (broken / item.name).symlink_to(item)
    (broken / "config.json").unlink()
    config = json.loads((converted / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "intermediate_size": 256}))
    with pytest.raises(ModelLoadError, match=r"\['layers'\]\[0\]\['w_\w+'\] .* has shape"):
        load_model(broken, tokenizer_path=None, dtype=np.float32)


def test_existing_target_needs_force(converted: Path) -> None:
    with pytest.raises(ValueError, match="exists; pass force=True"):
        convert_hf_checkpoint(default_model_dir(), converted)


def test_int8_round_trip(tmp_path: Path) -> None:
    """--quantization int8: the layer matmul weights stored as int8 codes + float16 scales,
    restored as they are (nothing quantized again), the engine running them quantized with
    the tokens of quantizing at load; another quantization asked for is a one-line error."""
    target = tmp_path / "int8"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts/convert_checkpoint.py"),
            str(default_model_dir()),
            str(target),
            "--quantization",
            "int8",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((target / MARKER).read_text())["quantization"] == "int8"
    restored = load_model(target, tokenizer_path=None, dtype=np.float32)
    assert restored.quantization == "int8"
    w_down = restored.params["layers"][0]["w_down"]
    assert set(w_down) == {"q", "scale", "min"} and w_down["q"].dtype == np.int8
    assert w_down["scale"].dtype == np.float16
    assert restored.params["embed"].dtype == np.float32  # the table keeps the dtype
    llm = LLM(str(target), **ENGINE)
    assert llm.stats()["quantization"] == "int8"
    got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == tokens(default_model_dir(), quantization="int8")
    from jaxcb.runtime.setup import _stored_quantization

    with pytest.raises(ValueError, match="stores int8 weights") as err:
        _stored_quantization(llm.engine.config.__class__(quantization="fp8"), "int8")
    assert "\n" not in str(err.value)


def test_float16_engine_and_round_trip(tmp_path: Path) -> None:
    """A float16 engine (for GPUs without bfloat16 speed): float16 weights computed as they
    are, KV pages float32 on CPU (the native kernels read no float16 pages); a float16
    checkpoint restores in float16 and gives the same tokens."""
    target = convert_hf_checkpoint(default_model_dir(), tmp_path / "f16", dtype="float16")
    assert json.loads((target / MARKER).read_text())["dtype"] == "float16"
    restored = load_model(target, tokenizer_path=None, dtype=np.float16)
    assert restored.params["layers"][0]["w_down"].dtype == np.float16
    llm = LLM(str(target), dtype="float16", **ENGINE)
    assert llm.engine.info.kv_cache_dtype == "float32"
    got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == tokens(default_model_dir(), dtype="float16")
    assert all(len(set(t)) > 3 for t in got)


def test_int8_checkpoint_of_a_tied_table_without_its_head(tmp_path: Path, monkeypatch) -> None:
    """An int8 checkpoint of a tied model converted before tables were quantized as heads
    (no lm_head saved) still loads and generates: the table restores in the model dtype and
    serves as the head too."""
    from helpers import make_hf_model

    from jaxcb.models import quant
    from jaxcb.models.loading import checkpoint_convert

    hf_dir = tmp_path / "tied"
    make_hf_model("qwen3", hf_dir)
    quantize = quant.quantize_params

    def without_head(*args, **kwargs):
        params, infos = quantize(*args, **kwargs)
        return {k: v for k, v in params.items() if k != "lm_head"}, infos

    monkeypatch.setattr(quant, "quantize_params", without_head)
    target = checkpoint_convert.convert_checkpoint(hf_dir, tmp_path / "old", quantization="int8")
    monkeypatch.undo()
    for matmul in ("auto", "xla"):  # xla: no packing that would declare a head by itself
        llm = LLM(str(target), matmul=matmul, **ENGINE)
        assert "embed" in llm.engine.runner.params and llm.stats()["quantization"] == "int8"
        assert llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
