"""What a compiled step says of itself on its target, per bucket, and the roofline it implies.

From an `AotBuild` (runtime/aot.py): each bucket's memory (memory_analysis: arguments,
outputs, temporaries, aliased), whether the weights, the KV pool and the largest program's
own buffers fit a chip, flops and bytes accessed, the roofline time of one step
(max(flops / peak, bytes / bandwidth), per chip: an SPMD program's figures are one
device's) and the decode rate it implies (S sequences / step time), and the bytes accessed
against the ideal (`ideal_step_bytes`).

Bytes are HBM traffic read off the optimized program (`hbm_traffic.py`: what each
instruction reads and writes outside VMEM, in-place and sliced accesses as such) plus the
Pallas kernels' declared `pl.CostEstimate`, twice: a greedy step (every `lax.cond` by its
lightest branch; it sets the roofline) and every option on (the heaviest branches). XLA's
own "bytes accessed" is kept beside them (on TPU it counts VMEM traffic too). Flops:
`cost_analysis()` on TPU; the GPU client does not implement it, so there XLA's HLO cost
analysis is run over the compiled module through the CPU client. Both count what the
program would touch whatever the live lengths: the kernels' estimates assume a full pool.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import jax

from jaxcb.engine.buckets import Bucket
from jaxcb.models.base import ModelSpec
from jaxcb.runtime import hbm_traffic
from jaxcb.runtime.aot import AotBuild, program_bytes
from jaxcb.runtime.xla_count_fixes import inplace_scatter_overcount, loop_flops_undercount
from pallas_kernels.ragged_paged_attention.kv_quant import is_quantized_kv

GB = 1e9
TRITON_CALL = 'custom_call_target="__gpu$xla.gpu.triton"'  # a Pallas Triton kernel in HLO


@dataclass(frozen=True)
class BucketReport:
    num_tokens: int
    num_seqs: int
    compile_seconds: float  # tracing, lowering and compiling
    lower_seconds: float  # tracing and lowering alone (a warm start still pays it)
    argument_bytes: int  # per device: weights, KV pool, step inputs
    output_bytes: int
    temp_bytes: int
    alias_bytes: int  # outputs written in place of a donated argument (the KV pool)
    program_bytes: int  # temporaries + outputs not aliased
    fits: bool  # arguments + program_bytes <= the chip's memory limit
    flops: float
    bytes_accessed: float  # HBM, every lax.cond by its heaviest branch (every option on)
    greedy_bytes: float  # HBM, every lax.cond by its lightest branch (a greedy step)
    xla_bytes_accessed: float  # XLA's own figure (on TPU: VMEM traffic included)
    cost_source: str
    roofline_seconds: float  # of the greedy step
    bound: str  # "compute" | "memory"
    decode_tokens_per_s: float  # num_seqs / roofline_seconds
    ideal_bytes: int
    bytes_vs_ideal: float  # greedy_bytes / ideal_bytes
    all_options_vs_ideal: float  # bytes_accessed / ideal_bytes
    context_len: int  # live tokens per sequence the ideal assumes


@dataclass(frozen=True)
class AotReport:
    target: str
    platform: str
    num_chips: int
    tensor_parallel_size: int
    attention: str
    model: str
    dtype: str
    quantization: str  # the layer weights' ("none": in dtype)
    kv_cache_dtype: str
    peak_flops: float  # per chip
    hbm_bandwidth: float
    memory_limit_bytes: int  # per chip, what the pool was sized against
    params_bytes: int  # per chip
    kv_pool_bytes: int  # per chip
    num_pages: int
    kv_pool_sizing: str  # how num_pages was decided
    max_program_bytes: int  # the largest bucket's temporaries + fresh outputs
    peak_bytes: int  # params + pool + max_program_bytes
    fits: bool
    context_len: int | None  # live tokens per sequence the ideal assumes, if given
    probe_seconds: float
    compile_seconds: float  # wall time for all buckets (without the probe)
    buckets: list[BucketReport]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class StepCost:
    flops: float
    hbm_bytes: float  # every lax.cond by its heaviest branch (every sampling option on)
    greedy_hbm_bytes: float  # every lax.cond by its lightest branch (a greedy decode)
    xla_bytes: float  # XLA's own "bytes accessed" (on TPU VMEM traffic too)
    source: str


def step_cost(
    compiled: jax.stages.Compiled, traced: jax.stages.Traced, kv_array_bytes: int
) -> StepCost:
    """Flops and bytes of one compiled step, per device.

    Bytes: HBM traffic by `hbm_traffic.hbm_bytes` over the optimized HLO (each conditional
    by its heaviest and by its lightest branch), plus the Pallas kernels' declared
    `pl.CostEstimate` bytes (read from the step's jaxpr, `traced`: jax 0.10.2's Triton
    lowering drops them, and the walker counts kernel calls as 0). XLA's own figure is kept
    alongside: on TPU `cost_analysis()`, which counts VMEM traffic too (a lone matmul: 4.7x
    its bytes); on GPU, where the client has no cost analysis, XLA's HLO cost analysis over
    the compiled module through the CPU client, corrected for the Triton calls (counted -1)
    and for the in-place KV scatters (counted as whole-pool reads and writes).

    Flops: `cost_analysis()` on TPU (Mosaic kernels as declared); on GPU the HLO cost
    analysis plus the Triton kernels' declared flops; on both, a scan's body once per
    trip (`loop_flops_undercount`), where XLA counts it once."""
    text = compiled.as_text()
    declared_calls, declared_flops, declared_bytes = declared_kernel_costs(traced.jaxpr)
    hbm = hbm_traffic.hbm_bytes(text) + declared_bytes
    greedy = hbm_traffic.hbm_bytes(text, branch="min") + declared_bytes
    source = "HBM bytes from the optimized HLO + the Pallas kernels' declared cost"
    cost = compiled.cost_analysis()
    if isinstance(cost, list):  # older jax: one dict per module
        cost = cost[0] if cost else None
    loops = loop_flops_undercount(text)
    if cost and "flops" in cost:
        flops, xla_bytes = float(cost["flops"]), float(cost.get("bytes accessed", 0.0))
        flops += loops
        return StepCost(flops, hbm, greedy, xla_bytes, source + "; flops: cost_analysis")
    from jaxlib import _jax

    cpu = jax.devices("cpu")[0].client
    flops, xla_bytes = loops, 0.0
    for module in compiled.runtime_executable().hlo_modules():
        figures = _jax.hlo_module_cost_analysis(cpu, module)
        flops += float(figures.get("flops", 0.0))
        xla_bytes += float(figures.get("bytes accessed", 0.0))
    call_sites = text.count(TRITON_CALL)
    if call_sites:
        num_calls = hbm_traffic.kernel_calls(text)  # (a scan's call: once per layer)
        if declared_calls != num_calls:
            raise ValueError(
                f"the compiled step makes {num_calls} Triton calls, its jaxpr {declared_calls} "
                "Pallas calls: cannot tell which cost estimate is whose"
            )
        flops += call_sites + declared_flops  # each call site counted -1
        xla_bytes += call_sites + declared_bytes
    xla_bytes -= inplace_scatter_overcount(text, kv_array_bytes)
    source += "; flops: HLO cost analysis (CPU client) + the Triton kernels' declared flops"
    return StepCost(flops, hbm, greedy, xla_bytes, source)


def declared_kernel_costs(jaxpr: Any) -> tuple[int, float, float]:
    """(calls, flops, bytes accessed) of the Pallas calls in a jaxpr, as their
    `pl.CostEstimate`s declare (none declared: 0), sub-jaxprs included (a scan's body
    times its length)."""
    calls, flops, accessed = 0, 0.0, 0.0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            estimate = eqn.params.get("cost_estimate")
            calls += 1
            flops += estimate.flops if estimate else 0.0
            accessed += estimate.bytes_accessed if estimate else 0.0
            continue
        times = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
                if hasattr(inner, "eqns"):
                    c, f, b = declared_kernel_costs(inner)
                    calls, flops, accessed = (
                        calls + times * c,
                        flops + times * f,
                        accessed + times * b,
                    )
    return calls, flops, accessed


def ideal_step_bytes(
    spec: ModelSpec,
    bucket: Bucket,
    *,
    params_bytes: int,
    itemsize: int,
    kv_itemsize: int,
    context_len: int,
    tensor_parallel_size: int = 1,
    kv_scale_bytes: int = 0,
) -> dict[str, int]:
    """The bytes one step must move at least, per device, by part: the weights once
    (`params_bytes`, per device; of an untied embedding table only the T rows looked up),
    the live KV once (num_seqs x context_len tokens), the new KV written (T tokens), and
    the activations: each matmul's input and output once per layer (`itemsize`) and the
    float32 logits of the num_seqs rows. `kv_scale_bytes`: a quantized pool's bytes of
    scale per token and KV head (4: one float32), besides its head_dim values."""
    t, s, tp = bucket.num_tokens, bucket.num_seqs, tensor_parallel_size
    h, d, i = spec.hidden_size, spec.head_dim, round(spec.active_intermediate_size)
    hq, hkv = spec.num_q_heads * d, spec.num_kv_heads * d
    kv_row = d * kv_itemsize + kv_scale_bytes  # one KV head's values (and scale)
    kv_token = 2 * spec.num_layers * spec.num_kv_heads * kv_row // tp  # K and V of one token
    weights = params_bytes
    if not spec.tie_word_embeddings:  # the lookup reads T rows, not the table
        weights += t * h * itemsize - spec.vocab_size * h * itemsize // tp
    per_layer = 4 * h + (hq + 2 * hkv + hq + 3 * i) // tp  # qkv, o, gate_up, down in + out
    activations = t * per_layer * itemsize * spec.num_layers + s * spec.vocab_size * 4 // tp
    parts = {
        "weights": weights,
        "live_kv": s * context_len * kv_token,
        "new_kv": t * kv_token,
        "activations": activations,
    }
    return parts | {"total": sum(parts.values())}


def report(build: AotBuild, *, context_len: int | None = None) -> AotReport:
    """The report of a compiled build. `context_len`: live tokens per sequence the ideal
    bytes assume; default, per bucket, the full pool shared by its S sequences, at most
    max_model_len each (what the attention kernels' cost estimates assume too)."""
    runner, spec, target = build.runner, build.spec, build.target
    pool_tokens = build.pool.num_pages * build.config.cache.page_size
    itemsize = jax.numpy.dtype(build.config.dtype).itemsize
    kv_dtype = jax.numpy.dtype(build.kv_dtype)
    page_values = build.config.cache.page_size * spec.num_kv_heads * spec.head_dim
    # one layer's K (or V) page array on a device (a quantized pool's scales apart)
    kv_array_bytes = (
        build.pool.num_pages * page_values * kv_dtype.itemsize // build.tensor_parallel_size
    )
    rows = []
    sampling_bytes_of: dict[int, int] = {}  # by S: one sampling program serves its buckets
    for bucket in build.buckets:
        compiled = runner.programs.compiled_step(bucket)
        mem = compiled.memory_analysis()
        traced = runner.programs.trace_step(bucket)
        cost = step_cost(compiled, traced, kv_array_bytes)
        # A step that samples or asks for logprobs runs the sampling program of its S after
        # the step: its traffic counts in the all-options bytes, its buffers in the peak.
        sampler = runner.programs.compiled_sampler(bucket.num_seqs)
        if bucket.num_seqs not in sampling_bytes_of:
            sampling_bytes_of[bucket.num_seqs] = hbm_traffic.hbm_bytes(sampler.as_text())
        sampling_bytes = sampling_bytes_of[bucket.num_seqs]
        compute_s = cost.flops / target.peak_flops
        memory_s = cost.greedy_hbm_bytes / target.hbm_bandwidth
        seconds = max(compute_s, memory_s)
        context = context_len or min(runner.max_model_len, pool_tokens // bucket.num_seqs)
        ideal = ideal_step_bytes(
            spec,
            bucket,
            params_bytes=build.params_bytes,
            itemsize=itemsize,
            kv_itemsize=kv_dtype.itemsize,
            kv_scale_bytes=4 if is_quantized_kv(kv_dtype) else 0,
            context_len=context,
            tensor_parallel_size=build.tensor_parallel_size,
        )["total"]
        program = max(program_bytes(compiled), program_bytes(sampler))
        rows.append(
            BucketReport(
                num_tokens=bucket.num_tokens,
                num_seqs=bucket.num_seqs,
                compile_seconds=runner.programs.bucket_compile_seconds[bucket],
                lower_seconds=runner.programs.lower_seconds[bucket],
                argument_bytes=mem.argument_size_in_bytes,
                output_bytes=mem.output_size_in_bytes,
                temp_bytes=mem.temp_size_in_bytes,
                alias_bytes=mem.alias_size_in_bytes,
                program_bytes=program,
                fits=mem.argument_size_in_bytes + program <= build.memory_limit_bytes,
                flops=cost.flops,
                bytes_accessed=cost.hbm_bytes + sampling_bytes,
                greedy_bytes=cost.greedy_hbm_bytes,
                xla_bytes_accessed=cost.xla_bytes,
                cost_source=cost.source,
                roofline_seconds=seconds,
                bound="compute" if compute_s >= memory_s else "memory",
                decode_tokens_per_s=bucket.num_seqs / seconds if seconds > 0 else math.inf,
                ideal_bytes=ideal,
                bytes_vs_ideal=cost.greedy_hbm_bytes / ideal,
                all_options_vs_ideal=(cost.hbm_bytes + sampling_bytes) / ideal,
                context_len=context,
            )
        )
    kv_pool_bytes = build.pool.num_pages * build.pool.page_bytes
    max_program = max(r.program_bytes for r in rows)
    peak = build.params_bytes + kv_pool_bytes + max_program
    return AotReport(
        target=target.name,
        platform=target.platform,
        num_chips=target.num_chips,
        tensor_parallel_size=build.tensor_parallel_size,
        attention=build.attention,
        model=str(build.config.model),
        dtype=str(build.config.dtype),
        quantization=build.config.quantization,
        kv_cache_dtype=str(build.kv_dtype),
        peak_flops=target.peak_flops,
        hbm_bandwidth=target.hbm_bandwidth,
        memory_limit_bytes=build.memory_limit_bytes,
        params_bytes=build.params_bytes,
        kv_pool_bytes=kv_pool_bytes,
        num_pages=build.pool.num_pages,
        kv_pool_sizing=build.pool.describe(),
        max_program_bytes=max_program,
        peak_bytes=peak,
        fits=peak <= build.memory_limit_bytes and all(r.fits for r in rows),
        context_len=context_len,
        probe_seconds=build.probe_seconds,
        compile_seconds=build.compile_seconds,
        buckets=rows,
    )


def _quantized(quantization: str) -> str:
    return "" if quantization == "none" else f" ({quantization} layers)"


def format_report(rep: AotReport) -> str:
    """The report as a table, one line per bucket, and a verdict."""
    lines = [
        f"target {rep.target} ({rep.platform}, {rep.num_chips} chip(s);"
        f" TP {rep.tensor_parallel_size}), attention {rep.attention},"
        f" {rep.dtype} weights{_quantized(rep.quantization)}, {rep.kv_cache_dtype} KV",
        f"per chip: peak {rep.peak_flops / 1e12:.0f} TFLOP/s, {rep.hbm_bandwidth / GB:.0f} GB/s,"
        f" memory limit {rep.memory_limit_bytes / GB:.2f} GB",
        f"KV pool: {rep.kv_pool_sizing}",
        "",
        f"{'bucket (T, S)':>14} {'compile s':>9} {'args GB':>8} {'out GB':>7} {'temp GB':>8}"
        f" {'alias GB':>8} {'fits':>4} {'GFLOP':>8} {'HBM GB':>7} {'ideal GB':>8} {'ratio':>6}"
        f" {'all-on GB':>9} {'ratio':>6}"
        f" {'roofline ms':>11} {'bound':>7} {'decode tok/s':>12}",
    ]
    for r in rep.buckets:
        lines.append(
            f"{f'({r.num_tokens}, {r.num_seqs})':>14} {r.compile_seconds:9.1f}"
            f" {r.argument_bytes / GB:8.2f} {r.output_bytes / GB:7.3f} {r.temp_bytes / GB:8.3f}"
            f" {r.alias_bytes / GB:8.2f} {'yes' if r.fits else 'NO':>4} {r.flops / 1e9:8.1f}"
            f" {r.greedy_bytes / GB:7.2f} {r.ideal_bytes / GB:8.2f} {r.bytes_vs_ideal:6.2f}"
            f" {r.bytes_accessed / GB:9.2f} {r.all_options_vs_ideal:6.2f}"
            f" {r.roofline_seconds * 1e3:11.3f} {r.bound:>7} {r.decode_tokens_per_s:12.0f}"
        )
    source = rep.buckets[0].cost_source if rep.buckets else "-"
    verdict = "fits" if rep.fits else "does not fit"
    lines += [
        "",
        f"flops and bytes: {source}",
        "HBM GB: a greedy step (every lax.cond by its lightest branch), which sets the roofline;"
        " all-on GB: every branch at its heaviest (sampling filters, penalties, logprobs,"
        " prompt logprobs at once), with the sampling program",
        "ideal bytes: weights once + live KV once + new KV + activations, at "
        + (
            f"{rep.context_len} live tokens per sequence"
            if rep.context_len
            else "a full KV pool shared by the S sequences (at most max_model_len each)"
        ),
        f"compile: {rep.compile_seconds:.1f}s for {len(rep.buckets)} buckets"
        + (f" (+{rep.probe_seconds:.1f}s sizing the pool)" if rep.probe_seconds else "")
        + f"; tracing and lowering {sum(r.lower_seconds for r in rep.buckets):.1f}s of it"
        " (what a start from the persistent cache still pays, besides loading the programs)",
        f"{verdict}: weights {rep.params_bytes / GB:.2f} + KV pool {rep.kv_pool_bytes / GB:.2f}"
        f" + largest step buffers {rep.max_program_bytes / GB:.2f} = {rep.peak_bytes / GB:.2f} GB"
        f" per chip, limit {rep.memory_limit_bytes / GB:.2f} GB",
    ]
    return "\n".join(lines)
