"""The whole step compiled for TPU (Mosaic) and H100 (Triton) without the hardware.

These compile for real through jax[tpu] / jax[cuda12] (the test extra installs both) on
compile-only devices; where a plugin is missing they skip. Tiny Llama and Qwen3 configs,
two buckets each, sampling and prefix caching on: each (target, model, TP) is one build.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from jaxcb.config import EngineConfig
from jaxcb.engine.buckets import Bucket
from jaxcb.models import registry
from jaxcb.runtime import aot, aot_report, hbm_traffic, xla_count_fixes
from jaxcb.runtime.programs import kernel_cache_options
from pallas_kernels.gpu_targets import cuda_plugin_installed

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
HAS_TPU = importlib.util.find_spec("libtpu") is not None
HAS_CUDA = cuda_plugin_installed()
needs_tpu = pytest.mark.skipif(not HAS_TPU, reason="jax[tpu] (libtpu) is not installed")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="jax[cuda12] is not installed")

# head_dim 128 (a TPU lane row), 4 KV heads (TP 4 splits them), vocab divisible by 4.
TINY = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
}
MODELS = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "tie_word_embeddings": True,
    },
}
SMALL = dict(
    dtype="bfloat16",
    max_model_len=256,
    page_size=16,
    token_buckets=(16, 32),
    max_num_batched_tokens=32,
    max_num_seqs=8,
    seq_buckets=(),
    enable_prefix_caching=True,
)


def load_script():
    spec = importlib.util.spec_from_file_location("aot_compile", SCRIPTS / "aot_compile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    def write(family: str) -> Path:
        path = tmp_path_factory.mktemp(family) / "config.json"
        path.write_text(json.dumps({**TINY, **MODELS[family]}))
        return path

    return {family: write(family) for family in MODELS}


CASES = [
    pytest.param(  # (v5e:2x2 compiles the same kernel, sharded): --runslow
        "v5e:1x1", "llama", 1, "pallas-tpu", "tpu_custom_call", marks=[needs_tpu, pytest.mark.slow]
    ),
    pytest.param("v5e:2x2", "qwen3", 4, "pallas-tpu", "tpu_custom_call", marks=needs_tpu),
    pytest.param(  # (h100x8 compiles the same kernel, sharded): --runslow
        "h100",
        "qwen3",
        1,
        "pallas-gpu",
        aot_report.TRITON_CALL,
        marks=[needs_cuda, pytest.mark.slow],
    ),
    pytest.param("h100x8", "llama", 2, "pallas-gpu", aot_report.TRITON_CALL, marks=needs_cuda),
]


@pytest.mark.parametrize(("target", "family", "tp", "backend", "kernel_call"), CASES)
def test_step_compiles_for_target(model_dir, target, family, tp, backend, kernel_call):
    # num_pages given: no sizing compile, except in the first H100 case (auto sizing).
    pages = {} if target == "h100" else {"num_pages": 96}
    config = EngineConfig.from_dict(
        None, model=str(model_dir[family]), tensor_parallel_size=tp, **SMALL, **pages
    )
    build = aot.compile_for_target(config, aot.get_target(target))
    rep = aot_report.report(build)
    assert rep.attention == backend and rep.tensor_parallel_size == tp
    assert [(b.num_tokens, b.num_seqs) for b in rep.buckets] == [(16, 8), (32, 8)]
    spec = build.spec
    params = registry.num_params(spec) * 2  # bf16
    assert params / tp <= rep.params_bytes < params / tp * 1.05  # (norms stay whole)
    programs = build.runner.programs
    if pages:
        assert rep.num_pages == 96 and rep.probe_seconds == 0
        assert set(programs.sampler_compile_seconds) == {8}
    else:  # sized from the target's memory, with the compiled step's buffers measured
        assert "device memory" in rep.kv_pool_sizing and rep.probe_seconds > 0
        assert rep.num_pages == 8 * 256 // 16  # max_num_seqs full sequences fit easily
        # the probe's sampling program is the runner's: not compiled a second time
        assert programs.sampler_compile_seconds == {} and programs.compiled_sampler(8)
    for b in rep.buckets:
        assert 0 < b.lower_seconds < b.compile_seconds and b.fits
        # The KV pool is donated: every one of its bytes is aliased, output to argument.
        assert b.alias_bytes == rep.kv_pool_bytes
        assert b.argument_bytes >= rep.params_bytes + rep.kv_pool_bytes
        # (a tiny model's scanned layers may keep every temporary in TPU VMEM: temp 0)
        assert b.temp_bytes >= 0 and b.program_bytes > 0
        assert b.flops > 0 and 0 < b.greedy_bytes <= b.bytes_accessed
        assert b.xla_bytes_accessed > 0
        assert 0.5 < b.bytes_vs_ideal <= b.all_options_vs_ideal < 100  # against the ideal
        assert b.roofline_seconds == max(
            b.flops / rep.peak_flops, b.greedy_bytes / rep.hbm_bandwidth
        )
        assert b.decode_tokens_per_s == pytest.approx(b.num_seqs / b.roofline_seconds)
    assert rep.fits and rep.peak_bytes <= rep.memory_limit_bytes
    # Attention went through the Pallas kernel (Mosaic / Triton), one call per layer.
    hlo = build.runner.programs.compiled_step(build.buckets[0]).as_text()
    assert kernel_call in hlo and hbm_traffic.kernel_calls(hlo) == spec.num_layers
    text = aot_report.format_report(rep)
    assert "(32, 8)" in text and text.splitlines()[-1].startswith("fits:")
    if kernel_call == aot_report.TRITON_CALL:  # GPU: a token count's programs share kernels
        options, _ = kernel_cache_options("step-16")
        assert Path(options["xla_gpu_kernel_cache_file"]).stat().st_size > 0


@pytest.mark.parametrize(
    ("target", "kv_dtype", "kernel_call"),
    [
        pytest.param("v5e:1x1", "int8", "tpu_custom_call", marks=needs_tpu),
        # (fp8 pages in the GPU kernel: test_rpa_gpu_compile.py; the whole step: --runslow)
        pytest.param("h100", "fp8", aot_report.TRITON_CALL, marks=[needs_cuda, pytest.mark.slow]),
    ],
)
def test_quantized_kv_pool_compiles_for_target(model_dir, target, kv_dtype, kernel_call):
    """int8 / fp8 KV pages with their float32 scales: the pool's bytes count the scales,
    the whole pool is donated, attention is the Pallas kernel reading them."""
    config = EngineConfig.from_dict(
        None, model=str(model_dir["llama"]), kv_cache_dtype=kv_dtype, num_pages=96, **SMALL
    )
    build = aot.compile_for_target(config, aot.get_target(target))
    rep = aot_report.report(build)
    assert rep.kv_cache_dtype == {"int8": "int8", "fp8": "float8_e4m3fn"}[kv_dtype]
    per_token = 2 * 2 * 4 * (128 + 4)  # K and V, 2 layers, 4 KV heads, 128 codes + a scale
    assert rep.kv_pool_bytes == 96 * 16 * per_token
    for b in rep.buckets:  # (TPU pads the small scale arrays' tiles: a little more there)
        assert rep.kv_pool_bytes <= b.alias_bytes < 1.05 * rep.kv_pool_bytes and b.fits
    hlo = build.runner.programs.compiled_step(build.buckets[0]).as_text()
    assert hbm_traffic.kernel_calls(hlo) == build.spec.num_layers and kernel_call in hlo


@needs_tpu
@pytest.mark.parametrize(
    ("target", "tp"),
    # (one chip: the same fusion without the gather check; --runslow)
    [pytest.param("v5e:1x1", 1, marks=pytest.mark.slow), ("v5e:2x2", 4)],
)
def test_int8_weights_fuse_into_the_dot_on_tpu(model_dir, target, tp):
    """int8 weights on an accelerator take the per-channel form (models/quant.weight_form):
    the codes converted inside the dot, the scale on its result. The compiled decode step
    then moves fewer HBM bytes than the bfloat16 one (hbm_traffic, as the report counts
    them: XLA's own figure counts the whole stack where a scanned layer retiles its int8
    slice on the way to VMEM); the grouped form materialized its dequantized weights there
    and moved more (10.4 GB vs 0.84 at Qwen3-8B's shapes). At TP 4 too: merging the gate/up
    weight's output axes before the dot had XLA gather it whole on every chip."""
    one_bucket = {**SMALL, "token_buckets": (16,), "max_num_batched_tokens": 16}
    tiny = {**TINY, **MODELS["llama"], "hidden_size": 512, "intermediate_size": 2048}
    path = model_dir["llama"].parent / "wide.json"
    path.write_text(json.dumps(tiny))
    moved = {}
    for quantization in ("none", "int8"):
        config = EngineConfig.from_dict(
            None,
            model=str(path),
            quantization=quantization,
            num_pages=96,
            tensor_parallel_size=tp,
            **one_bucket,
        )
        build = aot.compile_for_target(config, aot.get_target(target))
        rep = aot_report.report(build)
        (bucket,) = rep.buckets
        moved[quantization] = (rep.params_bytes, bucket.greedy_bytes)
        hlo = build.runner.programs.compiled_step(build.buckets[0]).as_text()
        gathered = [line for line in hlo.splitlines() if "all-gather" in line and "s8[" in line]
        assert not gathered, f"int8 weights gathered across the chips: {gathered[:2]}"
    (bf16_params, bf16_moved), (int8_params, int8_moved) = moved["none"], moved["int8"]
    assert int8_params < 0.7 * bf16_params  # int8 layers; the embedding stays bfloat16
    assert int8_moved < bf16_moved - 0.3 * (bf16_params - int8_params)


@needs_tpu
def test_lora_step_gathers_no_weight_at_tp4(model_dir):
    """LoRA's XLA form under tensor parallelism 4 (v5e x4): the adapters' gate/up term is
    added in the weight's [T, 2, I] output axes, as the base matmul leaves them. Flattened to
    [T, 2 * I] (I sharded), it had XLA gather each layer's whole gate/up weight on every chip:
    a Qwen3-8B-size decode step read 93.6 GB per chip against 6.6 GB."""
    one_bucket = {**SMALL, "token_buckets": (16,), "max_num_batched_tokens": 16}
    wide = {**TINY, **MODELS["qwen3"], "hidden_size": 1024, "intermediate_size": 4096}
    path = model_dir["qwen3"].parent / "wide-lora.json"
    path.write_text(json.dumps(wide))
    config = EngineConfig.from_dict(
        None,
        model=str(path),
        num_pages=96,
        tensor_parallel_size=4,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
        **one_bucket,
    )
    build = aot.compile_for_target(config, aot.get_target("v5e:2x2"))
    hlo = build.runner.programs.compiled_step(build.buckets[0]).as_text()
    lines = hlo.splitlines()
    gathered = [x.strip()[:160] for x in lines if "all-gather" in x and "bf16[" in x]
    assert not gathered, f"bfloat16 weights gathered across the chips: {gathered[:2]}"


@needs_cuda
def test_scanned_step_counts_every_layers_flops(model_dir):
    """XLA's cost analysis counts a while body once; the report counts a scanned step's
    layer once per layer (xla_count_fixes.loop_flops_undercount), so scanned and unrolled steps
    of a 6-layer model report the same flops (both costed by the HLO cost analysis on GPU)."""
    one_bucket = {**SMALL, "token_buckets": (32,), "max_num_batched_tokens": 32}
    path = model_dir["llama"].parent / "deep.json"
    path.write_text(json.dumps({**TINY, **MODELS["llama"], "num_hidden_layers": 6}))
    flops = {}
    for scan in (True, False):
        config = EngineConfig.from_dict(
            None, model=str(path), scan_layers=scan, num_pages=96, **one_bucket
        )
        build = aot.compile_for_target(config, aot.get_target("h100"))
        hlo = build.runner.programs.compiled_step(build.buckets[0]).as_text()
        undercount = xla_count_fixes.loop_flops_undercount(hlo)
        assert (undercount > 0) == scan
        (bucket,) = aot_report.report(build).buckets
        flops[scan] = bucket.flops
    assert flops[True] == pytest.approx(flops[False], rel=0.05)


def test_ideal_bytes_parts():
    spec = registry.spec_from_hf_config({**TINY, **MODELS["llama"]})
    parts = aot_report.ideal_step_bytes(
        spec,
        Bucket(8, 8),
        params_bytes=10_000,
        itemsize=2,
        kv_itemsize=2,
        context_len=100,
        tensor_parallel_size=1,
    )
    kv_token = 2 * 2 * 4 * 128 * 2  # K and V, 2 layers, 4 KV heads, head_dim 128, bf16
    assert parts["live_kv"] == 8 * 100 * kv_token and parts["new_kv"] == 8 * kv_token
    # untied: the lookup reads 8 rows of the table, not all 512
    assert parts["weights"] == 10_000 - 512 * 128 * 2 + 8 * 128 * 2
    assert parts["total"] == sum(v for k, v in parts.items() if k != "total")


def test_bad_target_is_one_line(model_dir, capsys):
    argv = ["--target", "v9z:1x1", "--model", str(model_dir["llama"])]
    assert load_script().main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "unknown target 'v9z:1x1'" in err and all(name in err for name in aot.TARGETS)


@pytest.mark.parametrize(
    "flags",
    [
        pytest.param(["--num-pages", "100000000"], id="huge-pool"),
        pytest.param(["--hbm-gb", "0.001"], id="tiny-hbm"),
    ],
)
@needs_cuda
def test_too_small_target_does_not_fit(model_dir, capsys, flags):
    argv = ["--target", "h100", "--model", str(model_dir["llama"]), *flags]
    argv += ["--max-model-len", "256", "--max-num-batched-tokens", "32", "--max-num-seqs", "8"]
    assert load_script().main(argv) == 1  # decided before any bucket is compiled
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "does not fit on h100" in err


def test_pool_sizing_leaves_room_for_the_step():
    from jaxcb.config import CacheConfig
    from jaxcb.runtime.kv_cache import CPU_AUTO_BUDGET_BYTES, page_bytes, size_kv_pool

    spec = registry.spec_from_hf_config({**TINY, **MODELS["llama"]})
    per_page = page_bytes(spec, 16, "bfloat16")
    common = dict(dtype="bfloat16", max_model_len=256, max_num_seqs=1000, params_bytes=4 << 20)
    # An accelerator's memory: limit x utilization - a device's weights - the compiled step's
    # buffers.
    sized = size_kv_pool(
        CacheConfig(memory_utilization=0.5),
        spec,
        memory_limit_bytes=1 << 30,
        program_bytes=100 << 20,
        tensor_parallel_size=2,
        **common,
    )
    spare = (1 << 29) - (4 << 20) - (100 << 20)
    assert sized.source == "device memory" and sized.page_bytes == per_page // 2
    assert sized.num_pages == spare // (per_page // 2) < sized.wanted_pages
    assert "compiled step 0.10" in sized.describe() and "x 0.5" in sized.describe()
    # On CPU (no memory limit known): a fixed budget less the weights, as before.
    cpu = size_kv_pool(CacheConfig(), spec, **common)
    assert cpu.source == "cpu budget"
    assert cpu.num_pages == min(cpu.wanted_pages, (CPU_AUTO_BUDGET_BYTES - (4 << 20)) // per_page)
    given = size_kv_pool(CacheConfig(num_pages=40), spec, **common)
    assert (given.num_pages, given.source) == (40, "num_pages")
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        size_kv_pool(CacheConfig(), spec, memory_limit_bytes=1 << 20, **common)


@needs_tpu
def test_weights_per_device_count_replicated_arrays_whole():
    """The pool is sized from one device's share of the weights: a sharded array's shard, a
    replicated one (norms; LoRA slot arrays' replicated halves) whole, not all of them / TP."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxcb.runtime import sharding

    mesh = sharding.replica_mesh(4, aot.target_devices("v5e:2x2")[:4])
    x = jax.ShapeDtypeStruct((8, 64), jnp.bfloat16)
    tree = {"sharded": x, "replicated": [x, x]}
    shardings = {
        "sharded": NamedSharding(mesh, PartitionSpec(None, sharding.TENSOR_AXIS)),
        "replicated": [NamedSharding(mesh, PartitionSpec())] * 2,
    }
    assert sharding.bytes_per_device(tree, shardings) == 8 * 16 * 2 + 2 * 8 * 64 * 2
    assert sharding.bytes_per_device(tree, shardings, skip=lambda leaf: True) == 0
