"""Honest FLOP counts of a workload and the machine's matmul peak on the model's own shapes;
the bytes a decode token reads and the memory's read limit.

Useful work only (shared/BENCHMARKS.md): per request, every token fed through the model
(the prompt and all generated tokens but the last) costs 2 x the decoder layers' matmul
weights; the lm_head is paid once per *sampled* token; causal attention costs 4 x head_dim x
num_q_heads per layer per visible (query, key) pair. Padding, recomputation after preemption
and a static batch's extra tokens are waste and are not counted.

The peak is measured, not quoted: a jitted `jnp.dot` with float32 accumulation (as jaxcb's
`dense`) on the shapes one step of the largest bucket runs, in the benchmark's dtype, median of
20 calls. Model FLOPs utilisation (MFU) = useful FLOP/s over the best of those figures; on
a shared machine that figure is itself noisy (a busy neighbour halves it).

A single stream's decode is bound by memory instead: each token reads every layer's matmul
weights and the LM head once. Its limit is those bytes over the read bandwidth of the
native probe (jaxcb.native.read_bandwidth: all cores, the widest loads, eight chains), taken
in the same minute as the decode it is set against: on a shared VM the probe reads 28-92
GB/s from one minute to the next.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from jaxcb.bench.workloads import Workload
from jaxcb.models.base import ModelSpec


def workload_flops(
    spec: ModelSpec, workload: Workload, output_lens: list[int] | None = None
) -> dict[str, float]:
    """Useful FLOPs of serving `workload` on a model of shape `spec`, split by kind;
    `output_lens`: the tokens each request really generated (default: its max_tokens)."""
    h, d = spec.hidden_size, spec.head_dim
    layer_weights = h * d * (2 * spec.num_q_heads + 2 * spec.num_kv_heads)  # q, o; k, v
    layer_weights += 3 * h * spec.active_intermediate_size  # gate, up, down (k experts)
    fed = sampled = pairs = 0
    lens = output_lens or [r.max_tokens for r in workload.requests]
    for r, m in zip(workload.requests, lens, strict=True):
        n = len(r.prompt_token_ids) + m - 1  # the last token is never fed back
        fed += n
        sampled += m
        pairs += n * (n + 1) // 2  # the token at position p sees p + 1 keys
    out = dict(
        matmul=2.0 * spec.num_layers * layer_weights * fed,
        lm_head=2.0 * spec.vocab_size * h * sampled,
        attention=4.0 * d * spec.num_q_heads * spec.num_layers * pairs,
    )
    out["total"] = sum(out.values())
    return out


def model_matmul_shapes(spec: ModelSpec, num_tokens: int, num_seqs: int) -> dict[str, tuple]:
    """(M, K, N) of the matmuls in one step of `num_tokens` tokens and `num_seqs` sequences."""
    h, d = spec.hidden_size, spec.head_dim
    return {
        "qkv": (num_tokens, h, (spec.num_q_heads + 2 * spec.num_kv_heads) * d),
        "o": (num_tokens, spec.num_q_heads * d, h),
        "gate_up": (num_tokens, h, 2 * round(spec.active_intermediate_size)),
        "down": (num_tokens, round(spec.active_intermediate_size), h),
        "lm_head": (num_seqs, h, spec.vocab_size),
    }


def measure_matmul_peak(shapes: dict[str, tuple], dtype: str, *, iters: int = 20) -> dict[str, Any]:
    """GFLOP/s of a jitted f32-accumulating `jnp.dot` per shape; `best` is the highest."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def matmul(a, b):
        return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype)

    key = jax.random.key(0)
    per_shape = {}
    for name, (m, k, n) in shapes.items():
        ka, kb = jax.random.split(jax.random.fold_in(key, m * k + n))
        a = jax.random.normal(ka, (m, k), dtype)
        b = jax.random.normal(kb, (k, n), dtype)
        matmul(a, b).block_until_ready()  # compile
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            matmul(a, b).block_until_ready()
            times.append(time.perf_counter() - start)
        per_shape[name] = dict(
            shape=[m, k, n], gflops=2 * m * k * n / statistics.median(times) / 1e9
        )
    return dict(
        dtype=dtype, per_shape=per_shape, best_gflops=max(v["gflops"] for v in per_shape.values())
    )


def decode_weight_bytes(spec: ModelSpec, itemsize: float) -> int:
    """Bytes of weights one decode token reads at `itemsize` bytes a weight: every layer's
    matmuls (a mixture of experts: its active experts) and the LM head. The norms' vectors
    and the one embedding row it gathers are left out (< 0.1% of a model)."""
    h, d = spec.hidden_size, spec.head_dim
    layer = h * d * (2 * spec.num_q_heads + 2 * spec.num_kv_heads)
    layer += 3 * h * spec.active_intermediate_size
    return round((spec.num_layers * layer + spec.vocab_size * h) * itemsize)


def measure_read_limit(nbytes: int, passes: int = 10) -> float | None:
    """The memory's read bandwidth now (bytes/s): the best of `passes` reads of an
    `nbytes` buffer on every usable core; None where the native kernels are not built."""
    from jaxcb import native

    if not native.available():
        return None
    return native.read_bandwidth(nbytes, passes=passes)
