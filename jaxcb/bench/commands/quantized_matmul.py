"""Time one transformer layer's matmuls with each weight form, as the engine's XLA path runs them.

For every number of rows T (decode batch sizes: T sequences, one token each) and every weight
form it times a chain of --layers Llama layers' four matmuls (wqkv, wo, gate_up with SwiGLU,
down) in one jitted call, so dispatch is paid once, and prints the median time per layer, the
weight bytes a layer reads, and the bandwidth that implies. Every layer reuses the same
weights: one layer's matrices are far larger than a GPU's L2, so each is read again from
memory. A form whose dequantization XLA fuses into the dot reads its stored bytes once; one
that is materialized reads and writes a float copy every call and is slower than bfloat16.

Forms (models/quant.py): bf16 (the model dtype), int8 (groups of 32 with a minimum: the CPU
form), int8_channel (per output channel: the GPU/TPU form), fp8 (e4m3, per channel).

    python -m jaxcb.bench quantized_matmul                     # Llama-3-8B shapes
    python -m jaxcb.bench quantized_matmul --rows 1,64 --hidden 576 --intermediate 1536 \\
        --heads 9 --kv-heads 3 --head-dim 64                    # SmolLM2-135M shapes
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcb.bench.commands import SharedFlags
from jaxcb.bench.timing import median_seconds
from jaxcb.models.layers import dense
from jaxcb.models.quant import (
    quantize_fp8,
    quantize_int8,
    quantize_int8_channel,
    quantized_matmul,
    weight_bytes,
)

FORMS = ("bf16", "int8", "int8_channel", "fp8")

DESCRIPTION = "a Llama layer's matmuls with each weight form (bf16, int8, fp8) through XLA"
FLAGS = SharedFlags(repeats=10, repeats_help="timed calls", repeats_alias="--iters")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", default="1,16,64,256", help="comma list of T (rows of x)")
    parser.add_argument("--forms", default=",".join(FORMS), help=f"comma list of {FORMS}")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=16, help="layers chained in one call")


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    unknown = set(args.forms.split(",")) - set(FORMS)
    if unknown:
        parser.error(f"unknown --forms {sorted(unknown)}; choose from {list(FORMS)}")


def layer_shapes(args: argparse.Namespace) -> dict[str, tuple[int, int]]:
    """[in, out] of a Llama layer's four matmuls (q, k, v and gate, up fused as jaxcb holds
    them)."""
    h, d = args.hidden, args.head_dim
    return {
        "wqkv": (h, (args.heads + 2 * args.kv_heads) * d),
        "wo": (args.heads * d, h),
        "w_gate_up": (h, 2 * args.intermediate),
        "w_down": (args.intermediate, h),
    }


def make_weight(form: str, shape: tuple[int, int], rng: np.random.Generator):
    w = (rng.standard_normal(shape, np.float32) * 0.02).astype(jnp.bfloat16)
    if form == "bf16":
        return jnp.asarray(w)
    quantize = {"int8": quantize_int8, "int8_channel": quantize_int8_channel, "fp8": quantize_fp8}
    return jax.tree_util.tree_map(jnp.asarray, quantize[form](w))


def matmul(x: jax.Array, w) -> jax.Array:
    return quantized_matmul(x, w) if isinstance(w, dict) else dense(x, w)


@functools.partial(jax.jit, static_argnames=("num_layers", "q_width", "intermediate"))
def layers(x: jax.Array, w, *, num_layers: int, q_width: int, intermediate: int) -> jax.Array:
    """x [T, H] through num_layers layers' matmuls (no attention: the query slice of the
    qkv projection goes to wo), each output rescaled to unit RMS."""
    for _ in range(num_layers):
        h = matmul(matmul(x, w["wqkv"])[:, :q_width], w["wo"])
        gate_up = matmul(h, w["w_gate_up"])
        h = matmul(jax.nn.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:], w["w_down"])
        x = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)
    return x


def run(args: argparse.Namespace, record: dict[str, Any]) -> None:
    rows = [int(r) for r in args.rows.split(",")]
    forms = args.forms.split(",")
    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}")
    shapes = layer_shapes(args)
    print("layer matmuls [in, out]: " + ", ".join(f"{k} {v}" for k, v in shapes.items()))
    rng = np.random.default_rng(0)
    header = f"{'form':<14}{'T':>5}{'ms/layer':>10}{'MB read':>10}{'GB/s':>8}{'speedup':>9}"
    print(header + "\n" + "-" * len(header))
    records, bf16_ms = [], {}
    for form in forms:
        weights = {k: make_weight(form, s, rng) for k, s in shapes.items()}
        nbytes = weight_bytes(weights)
        for t in rows:
            x = jnp.asarray(rng.standard_normal((t, args.hidden), np.float32))
            call = functools.partial(
                layers,
                x,
                weights,
                num_layers=args.layers,
                q_width=args.heads * args.head_dim,
                intermediate=args.intermediate,
            )
            seconds = median_seconds(call, (), args.repeats) / args.layers
            ms = seconds * 1e3
            bf16_ms.setdefault(t, ms if form == "bf16" else None)
            ratio = bf16_ms[t] / ms if bf16_ms.get(t) else float("nan")
            print(
                f"{form:<14}{t:>5}{ms:>10.3f}{nbytes / 1e6:>10.1f}"
                f"{nbytes / seconds / 1e9:>8.1f}{ratio:>9.2f}"
            )
            records.append(dict(form=form, rows=t, ms=ms, weight_bytes=nbytes, vs_bf16=ratio))
        del weights
    record["meta"] = dict(
        device=device.device_kind, platform=jax.default_backend(), jax=jax.__version__
    )
    record["results"] = records
