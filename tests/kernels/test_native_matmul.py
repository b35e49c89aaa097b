"""jaxcb's native matmuls over packed weights (jaxcb/native): the packed layouts, each kernel
(bfloat16 on AMX tiles, with AVX512-BF16 dot products or widened in AVX2 registers; float32
with AVX-512 or AVX2 FMAs) against XLA's dot, the ISA levels and the forced-ISA switch, and the
engine choosing one (kernels.matmul). Kernel tests skip on CPUs without that instruction set
(the AVX2 ones run on every AVX-512 CPU too); the layouts and the choice are checked
everywhere."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY_MODEL

from jaxcb import LLM, SamplingParams, native
from jaxcb.config import MATMUL_BACKENDS
from jaxcb.models.cpu_params import matmul_backend, matmul_report

KERNELS = [
    pytest.param(
        name,
        marks=pytest.mark.skipif(not spec.available(), reason=f"no {name} on this CPU"),
    )
    for name, spec in native.PACKED_MATMULS.items()
]


def test_pack_layout():
    """Block (n, k), row r, lane 2c + p holds w[32k + 2r + p, 16n + c]."""
    k, n = 64, 48
    w = np.arange(k * n, dtype=np.float32).reshape(k, n).astype(jnp.bfloat16)
    packed = native.pack_bf16(w)
    assert packed.shape == (n // 16, k // 32, 16, 32)
    rng = np.random.default_rng(0)
    for _ in range(50):
        nb, kb, r, c, p = (int(rng.integers(s)) for s in (n // 16, k // 32, 16, 16, 2))
        assert packed[nb, kb, r, 2 * c + p] == w[32 * kb + 2 * r + p, 16 * nb + c]


def test_pack_f32_layout():
    """Block n, row k, lane c holds w[k, 16n + c]."""
    w = np.arange(24 * 48, dtype=np.float32).reshape(24, 48)
    packed = native.pack_f32(w)
    assert packed.shape == (3, 24, 16)
    assert packed[2, 5, 7] == w[5, 39] and packed[0, 23, 15] == w[23, 15]


def test_pack_rejects_shapes_off_the_tiles():
    assert native.can_pack_bf16((64, 48)) and not native.can_pack_bf16((48, 64))
    with pytest.raises(ValueError, match="K must divide by 32 and N by 16"):
        native.pack_bf16(np.zeros((64, 40), jnp.bfloat16))
    assert native.can_pack_f32((24, 48)) and not native.can_pack_f32((48, 24))
    with pytest.raises(ValueError, match="N must divide by 16"):
        native.pack_f32(np.zeros((64, 40), np.float32))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(
    "m, k, n",
    # the last: an output over 8 MB, written with non-temporal stores
    [
        (1, 32, 16),
        (7, 64, 48),
        (16, 64, 16),
        (33, 96, 80),
        (64, 512, 768),
        (130, 256, 96),
        (70, 32, 32048),
    ],
)
def test_matmul_matches_xla_dot(kernel, m, k, n):
    spec = native.PACKED_MATMULS[kernel]
    rng = np.random.default_rng(m + k + n)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((k, n)), spec.dtype)
    expected = jnp.dot(
        x.astype(spec.dtype).astype(jnp.float32),
        w.astype(jnp.float32),
        precision="highest",
    )
    got = jax.jit(spec.kernel)(x, jnp.asarray(spec.pack(np.asarray(w))))
    assert got.shape == (m, n) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-4)


FUSED = [p for p in KERNELS if native.PACKED_MATMULS[p.values[0]].swiglu is not None]
WITH_ARGMAX = [p for p in KERNELS if native.PACKED_MATMULS[p.values[0]].argmax is not None]


@pytest.mark.parametrize("kernel", WITH_ARGMAX)
@pytest.mark.parametrize("m, k, n", [(1, 32, 16), (7, 64, 48), (70, 32, 32048), (130, 96, 4000)])
def test_matmul_argmax_is_the_matmul_and_its_row_argmax(kernel, m, k, n):
    spec = native.PACKED_MATMULS[kernel]
    rng = np.random.default_rng(m * n)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    packed = jnp.asarray(spec.pack(rng.standard_normal((k, n)).astype(spec.dtype)))
    out, ids = jax.jit(spec.argmax)(x, packed)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.jit(spec.kernel)(x, packed)))
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(jnp.argmax(out, axis=1)))


@pytest.mark.parametrize("kernel", WITH_ARGMAX)
def test_matmul_argmax_ties_go_to_the_first_column(kernel):
    spec = native.PACKED_MATMULS[kernel]
    w = np.zeros((32, 4000), np.float32)
    w[:, [3000, 100, 2999]] = 1.0  # three equal maxima in different work items
    x = jnp.ones((5, 32), jnp.float32)
    _, ids = jax.jit(spec.argmax)(x, jnp.asarray(spec.pack(w.astype(spec.dtype))))
    assert np.asarray(ids).tolist() == [100] * 5
    _, ids = jax.jit(spec.argmax)(x, jnp.asarray(spec.pack(np.zeros_like(w).astype(spec.dtype))))
    assert np.asarray(ids).tolist() == [0] * 5


@pytest.mark.parametrize("kernel", FUSED)
@pytest.mark.parametrize("m, k, i", [(1, 32, 16), (7, 64, 48), (13, 96, 64), (64, 512, 1536)])
def test_swiglu_matches_xla(kernel, m, k, i):
    """silu(x @ w_gate) * (x @ w_up) from one packed [K, 2 * I] weight, written in the
    kernel's act_dtype; I/16 odd exercises the last gate block paired alone."""
    spec = native.PACKED_MATMULS[kernel]
    rng = np.random.default_rng(m + k + i)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    x = x.at[0, :].set(40.0)  # large |gate| on both sides: silu's tails
    w = jnp.asarray(rng.standard_normal((k, 2 * i)), spec.dtype)
    gu = jnp.dot(
        x.astype(spec.dtype).astype(jnp.float32), w.astype(jnp.float32), precision="highest"
    )
    expected = (jax.nn.silu(gu[:, :i]) * gu[:, i:]).astype(spec.act_dtype)
    got = jax.jit(spec.swiglu)(x, jnp.asarray(spec.pack(np.asarray(w))))
    assert got.shape == (m, i) and got.dtype == spec.act_dtype
    tol = 1e-2 if spec.act_dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(expected, np.float32), rtol=tol, atol=tol
    )


NORMED = [p for p in KERNELS if p.values[0] in native.NORM_TARGETS]


@pytest.mark.parametrize("kernel", NORMED)
@pytest.mark.parametrize("rows", [1, 5, 13])
def test_norm_fused_matmul_is_the_matmul_of_the_normed_rows(kernel, rows):
    """native.packed_norm_matmul on a float kernel: the rows RMS-normed in its call (the
    norm weight float32 or bfloat16), rounded to the weights' dtype as the unfused call's
    input is, then the same matmul / SwiGLU; the padding rows stay zero. The bf16 kernels
    agree to the bit here: the last-ulp difference of a float32 sum in another order rarely
    survives the rounding to bf16."""
    from jaxcb.models.layers import rms_norm

    spec = native.PACKED_MATMULS[kernel]
    k, n = 96, 64
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((16, k)) * 3.0, jnp.float32)
    g32 = jnp.asarray(rng.uniform(0.5, 1.5, k), jnp.float32)
    w = rng.standard_normal((k, 2 * n)).astype(np.float32).astype(spec.dtype)
    real = jnp.int32(rows)
    fused = jax.jit(native.packed_norm_matmul, static_argnames=("kernel", "eps", "swiglu"))
    for g in (g32, g32.astype(jnp.bfloat16)):
        for swiglu, plain in [(False, spec.kernel), (True, spec.swiglu)]:
            packed = jnp.asarray(spec.pack(w if swiglu else w[:, :n]))
            got = fused(
                x=x, weight=g, w_packed=packed, rows=real, kernel=kernel, eps=1e-5, swiglu=swiglu
            )
            want = jax.jit(plain)(rms_norm(x, g, 1e-5), packed, real)
            assert got.shape == want.shape and got.dtype == want.dtype
            got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
            assert not got[rows:].any()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", [0, 5, 13])
def test_padding_rows_are_skipped_and_zero(kernel, rows):
    """With `rows` real rows of 13, every entry point returns the full-batch result on those
    rows (bit for bit: a row's sums do not depend on the others) and zeros past them; the
    argmax of a padding row is token 0. Out-of-range counts mean all rows."""
    spec = native.PACKED_MATMULS[kernel]
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((13, 64)), jnp.float32) + 1.0  # no zero rows
    packed = jnp.asarray(spec.pack(rng.standard_normal((64, 4000)).astype(spec.dtype)))
    n = jnp.int32(rows)
    for fn in filter(None, (spec.kernel, spec.swiglu)):
        full, got = np.asarray(jax.jit(fn)(x, packed)), np.asarray(jax.jit(fn)(x, packed, n))
        np.testing.assert_array_equal(got[:rows], full[:rows])
        assert not got[rows:].any() and full[rows:].all()
    for out_of_range in (-1, 14):
        np.testing.assert_array_equal(
            np.asarray(jax.jit(spec.kernel)(x, packed, jnp.int32(out_of_range))),
            np.asarray(jax.jit(spec.kernel)(x, packed)),
        )
    if spec.argmax is not None:
        out, ids = jax.jit(spec.argmax)(x, packed, n)
        full_out, full_ids = jax.jit(spec.argmax)(x, packed)
        np.testing.assert_array_equal(np.asarray(out)[:rows], np.asarray(full_out)[:rows])
        want = np.asarray(full_ids)[:rows].tolist() + [0] * (13 - rows)
        assert np.asarray(ids).tolist() == want


F32_PAIR = pytest.mark.skipif(
    not (native.PACKED_MATMULS["avx512"].available() and native.PACKED_MATMULS["avx2"].available()),
    reason="needs AVX-512 (the AVX2 kernels run there too)",
)


@F32_PAIR
@pytest.mark.parametrize("m, k, n", [(1, 64, 48), (13, 96, 4000), (64, 512, 1536)])
def test_float32_kernels_agree_bit_for_bit_across_isa_levels(m, k, n):
    """Each output column is one FMA chain over k in the AVX2 kernel (two 8-lane halves) and
    the AVX-512 one (16 lanes): the same float32 results, bit for bit, so greedy tokens do not
    depend on the machine's vector width."""
    rng = np.random.default_rng(m + n)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    packed = jnp.asarray(native.pack_f32(rng.standard_normal((k, 2 * n)).astype(np.float32)))
    wide, narrow = native.PACKED_MATMULS["avx512"], native.PACKED_MATMULS["avx2"]
    for fn in ("kernel", "swiglu"):
        np.testing.assert_array_equal(
            np.asarray(jax.jit(getattr(wide, fn))(x, packed)),
            np.asarray(jax.jit(getattr(narrow, fn))(x, packed)),
        )


def test_isa_levels_and_the_forced_isa_switch(monkeypatch):
    """Libraries are built per named ISA level (never -march=native) and a level this CPU
    cannot run is never loaded; JAXCB_CPU_ISA caps the level: with avx2 on an AVX-512 CPU,
    auto picks the AVX2 kernels and says why the AVX-512 ones were not."""
    from jaxcb.native import build

    assert not any("native" in f for f in build.FLAGS)
    paths = {build._library_path(level) for level in build.ISA_LEVELS.values()}
    assert len(paths) == len(build.ISA_LEVELS)
    levels = native.supported_levels()
    assert levels[0] == "generic" and native.active_level() == levels[-1]
    for name in build.ISA_LEVELS:
        if name not in levels:
            with pytest.raises(native.NativeBuildError, match=f"cannot run the {name} kernels"):
                build.load(name)
    monkeypatch.setenv(native.ISA_ENV, "avx3")
    with pytest.raises(ValueError, match="JAXCB_CPU_ISA='avx3': expected auto or one of"):
        native.active_level()
    monkeypatch.setenv(native.ISA_ENV, "generic")
    assert native.active_level() == "generic"
    assert matmul_backend("auto", dtype=jnp.float32, tensor_parallel_size=1) == "xla"
    if "avx512" not in levels:
        return
    monkeypatch.setenv(native.ISA_ENV, "avx2")
    assert native.active_level() == "avx2"
    assert matmul_backend("auto", dtype=jnp.float32, tensor_parallel_size=1) == "avx2"
    assert matmul_backend("auto", dtype=jnp.bfloat16, tensor_parallel_size=1) == "avx2_bf16"
    with pytest.raises(ValueError, match="JAXCB_CPU_ISA caps the kernels at avx2"):
        matmul_backend("avx512", dtype=jnp.float32, tensor_parallel_size=1)
    report = matmul_report("avx2", requested="auto", dtype=jnp.float32, tensor_parallel_size=1)
    assert report["avx2"] == "in use" and "caps the kernels at avx2" in report["avx512"]
    assert report["amx"] == "the weights are float32, not bfloat16"


def test_matmul_backend_choice():
    assert matmul_backend("xla", dtype=jnp.bfloat16, tensor_parallel_size=1) == "xla"
    assert matmul_backend("auto", dtype=jnp.bfloat16, tensor_parallel_size=2) == "xla"
    for dtype in (jnp.bfloat16, jnp.float32):
        runnable = [
            name
            for name, spec in native.PACKED_MATMULS.items()
            if spec.available() and spec.dtype == dtype
        ]
        expected = [*runnable, "xla"][0]
        assert matmul_backend("auto", dtype=dtype, tensor_parallel_size=1) == expected
    for kernel, spec in native.PACKED_MATMULS.items():
        other = jnp.float32 if spec.dtype == jnp.bfloat16 else jnp.bfloat16
        with pytest.raises(ValueError, match=f"not {jnp.dtype(spec.dtype).name}"):
            matmul_backend(kernel, dtype=other, tensor_parallel_size=1)
        with pytest.raises(ValueError, match="tensor parallelism"):
            matmul_backend(kernel, dtype=spec.dtype, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="matmul must be one of"):
        LLM(matmul="onednn")


def test_config_names_every_packed_kernel():
    """config.py (host side, no jax) lists the kernels.matmul choices by name: the native
    kernel table and that list must not drift apart."""
    assert ("auto", *native.PACKED_MATMULS, "xla") == MATMUL_BACKENDS


@pytest.mark.parametrize("kernel", KERNELS)
def test_engine_on_native_matmul_matches_xla_matmuls(kernel):
    """The same engine with its matmuls on a native kernel and on XLA: same greedy tokens
    (both multiply in the weights' dtype and accumulate in float32)."""
    config = dict(
        model=TINY_MODEL,
        dtype=jnp.dtype(native.PACKED_MATMULS[kernel].dtype).name,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        token_buckets=[16, 64],
        num_pages=64,
        max_model_len=256,
        attention="native",
    )
    packed = LLM(matmul=kernel, **config)
    xla = LLM(matmul="xla", **config)
    assert (packed.engine.info.matmul_backend, xla.engine.info.matmul_backend) == (kernel, "xla")
    kernels = packed.stats()["kernels"]
    assert kernels["matmul"] == kernel and kernels["matmul_kernels"][kernel] == "in use"
    assert kernels["cpu"] == native.cpu_summary() and kernels["isa_level"] in native.ISA_LEVELS
    assert xla.stats()["kernels"]["matmul_kernels"][kernel] == "kernels.matmul=xla"
    # the AVX2 kernels' many-row tile shape, as this CPU's probe picked it (test_tile_shapes)
    tiles = native.tile_shapes("avx2") if kernel.startswith("avx2") else {}
    assert kernels["tile_shapes"] == tiles and xla.stats()["kernels"]["tile_shapes"] == {}
    layer = packed.engine.runner.params["layers"][0]
    for name in ("wqkv", "wo", "w_gate_up", "w_down"):
        assert list(layer[name]) == [kernel]
    prompts = [[10, 11, 12, 13], list(range(40, 90))]
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    for a, b in zip(
        packed.generate(prompts, sp, use_tqdm=False),
        xla.generate(prompts, sp, use_tqdm=False),
        strict=True,
    ):
        assert a.outputs[0].token_ids[:4] == b.outputs[0].token_ids[:4]
