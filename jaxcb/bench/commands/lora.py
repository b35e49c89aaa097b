"""LoRA adapters' cost: throughput with adapters mixed in, without them, and without LoRA at
all; and what loading an adapter while serving does to the steps around it.

Two engines of the same model and config in one process, one with LoRA enabled
(`max_loras` = --num-adapters slots of rank --rank), one without. --num-adapters random-weight
PEFT adapters of that rank (every attention and MLP projection; a mixture of experts' attention
only) are written to a temporary directory. Each round runs the workload (EOS ignored, so
every pass makes the same tokens), its prefix cache reset first, as:

- `off`: the engine without LoRA, base model;
- `base`: the LoRA engine, no request with an adapter (what LoRA costs a step that uses none);
- `mixed`: the LoRA engine, the requests spread evenly over the adapters.

The ratios to `off` of the same round are printed (after a pass of each to warm up), then
their medians over the rounds; every other round runs the passes backwards (mixed, base,
off), so a drift over a round favours no pass. Then the load test: requests decode on the
LoRA engine while one more adapter is added with a request of its own. The adapter is read
first, as the server reads it off the engine's thread; then written into a slot (evicting
the least recently used) between two steps. The steps around it are timed (the slowest against the
median, and against the slowest of a control run where a base request arrives instead: a
new request's prefill lengthens its step whatever its adapter), the step programs traced
meanwhile counted (0: nothing recompiled), and the new request must finish.

    python -m jaxcb.bench lora                         # SmolLM2-135M, chat-fixed, 4 x rank 16
    python -m jaxcb.bench lora --dtype bfloat16 --config configs/bench-smollm2-cpu.yaml
    python -m jaxcb.bench lora --num-adapters 8 --rank 64 --num-requests 32

Every engine flag applies (as scripts/serve.py takes them); --json writes every round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from jaxcb import LLM, LoRARequest, SamplingParams
from jaxcb.bench.commands import SharedFlags, UsageError, positive_int
from jaxcb.bench.smollm2 import smollm2_hf_dir
from jaxcb.bench.workloads import WORKLOADS, make_workload
from jaxcb.cli import add_engine_args, engine_config_from_args
from jaxcb.models.base import ModelSpec
from jaxcb.runtime import step as step_module

DESCRIPTION = "LoRA: throughput with adapters mixed in, without, without LoRA; a load's stall"
FLAGS = SharedFlags(repeats=2, repeats_help="rounds of the three passes, in turns")
SMOLLM2_VOCAB = 49152


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-adapters", type=positive_int, default=4, help="adapters (slots)")
    parser.add_argument("--rank", type=positive_int, default=16, help="every adapter's rank")
    parser.add_argument(
        "--workload", choices=sorted(WORKLOADS), default="chat-fixed", help="the requests"
    )
    parser.add_argument(
        "--num-requests", type=positive_int, default=64, help="the workload's first N requests"
    )
    add_engine_args(parser)


def adapter_modules(spec: ModelSpec, dense_mlp: bool) -> dict[str, tuple[str, int, int]]:
    """Hugging Face module -> (its block, in, out) of a model of `spec`."""
    h, d, i = spec.hidden_size, spec.head_dim, spec.intermediate_size
    modules = {
        "q_proj": ("self_attn", h, spec.num_q_heads * d),
        "k_proj": ("self_attn", h, spec.num_kv_heads * d),
        "v_proj": ("self_attn", h, spec.num_kv_heads * d),
        "o_proj": ("self_attn", spec.num_q_heads * d, h),
    }
    if dense_mlp:
        modules |= {
            "gate_proj": ("mlp", h, i),
            "up_proj": ("mlp", h, i),
            "down_proj": ("mlp", i, h),
        }
    return modules


def write_adapter(path: Path, spec: ModelSpec, rank: int, seed: int, dense_mlp: bool) -> None:
    """A random-weight PEFT adapter directory for a model of `spec`."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(spec.num_layers):
        for module, (block, fan_in, fan_out) in adapter_modules(spec, dense_mlp).items():
            name = f"base_model.model.model.layers.{layer}.{block}.{module}"
            a = rng.normal(0, fan_in**-0.5, (rank, fan_in)).astype(np.float32)
            tensors[f"{name}.lora_A.weight"] = a
            tensors[f"{name}.lora_B.weight"] = rng.normal(0, 0.02, (fan_out, rank)).astype(
                np.float32
            )
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}
    (path / "adapter_config.json").write_text(json.dumps(config))


def one_pass(llm: LLM, prompts: list, params: list, loras: list | None) -> dict:
    """One timed generate of the workload, the prefix cache reset first (as the offline
    benchmark's passes): a pass would otherwise reuse the pages of the one before, which a
    pass under other adapters cannot (their hashes differ), and the ratios would measure the
    cache rather than the adapters."""
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": seconds, "output_tokens": tokens, "tok_s": tokens / seconds}


def arrival_steps(llm: LLM, lora: LoRARequest | None, vocab: int) -> dict:
    """Decode 16 base requests; one more request arrives mid-way, under `lora` (added to the
    engine in that step, its adapter read first, as the server reads it off the engine's
    thread: the step writes it into a slot, evicting the least recently used) or under the
    base model (None: the control). The 24 steps around it are timed."""
    engine = llm.engine
    values = engine.read_lora(lora) if lora is not None else None
    rng = np.random.default_rng(1)
    sp = SamplingParams(max_tokens=48, ignore_eos=True, temperature=0.0)
    for _ in range(16):
        engine.add_request(None, rng.integers(3, vocab, size=32).tolist(), sp)
    for _ in range(8):  # prefills and the first decodes
        engine.step()
    times, traces = [], step_module.TRACE_COUNT[0]
    added_at, done, rid = 12, None, None
    for k in range(24):
        t0 = time.perf_counter()
        if k == added_at:
            if lora is not None:
                engine.add_lora(lora, values)
            prompt = rng.integers(3, vocab, size=32).tolist()
            rid = engine.add_request(None, prompt, sp, lora_request=lora)
        outs = engine.step()
        times.append(time.perf_counter() - t0)
        done = done or next((o for o in outs if o.request_id == rid and o.finished), None)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                done = out
    median = statistics.median(times)
    return {
        "step_ms": [t * 1e3 for t in times],
        "median_step_ms": median * 1e3,
        "max_step_ms": max(times) * 1e3,
        "added_step_ms": times[added_at] * 1e3,
        "max_over_median": max(times) / median,
        "traced": step_module.TRACE_COUNT[0] - traces,
        "answered": bool(done is not None and done.outputs[0].token_ids),
    }


def load_while_serving(llm: LLM, lora: LoRARequest, vocab: int) -> dict:
    """`arrival_steps` for a base request (the control), then for `lora`'s: a new request's
    prefill lengthens the steps that take it (and 17 rows take a larger bucket than 16)
    whatever its adapter, so the load's cost is what its steps take beyond the control's.
    Returns the load's figures, with the control's under "control" and the slowest step over
    the control's slowest as "max_over_control"."""
    control = arrival_steps(llm, None, vocab)
    load = arrival_steps(llm, lora, vocab)
    return load | {
        "control": control,
        "max_over_control": load["max_step_ms"] / control["max_step_ms"],
    }


def run(args: argparse.Namespace, record: dict[str, Any]) -> None:
    given = engine_config_from_args(args)
    with_lora = given.replace(
        enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.rank
    )
    llm = LLM(config=with_lora)
    plain = LLM(config=given)
    spec = llm.engine.runner.spec
    dense_mlp = "w_gate_up" in llm.engine.runner.params["layers"][-1]["lora"]
    model_dir = Path(llm.engine.info.model_path)
    if not model_dir.is_dir():  # a GGUF file: the text workloads take SmolLM2's tokenizer
        model_dir = smollm2_hf_dir()
        if WORKLOADS[args.workload].source == "text" and spec.vocab_size != SMOLLM2_VOCAB:
            raise UsageError(
                f"--workload {args.workload} needs the model's tokenizer: give --model a "
                "Hugging Face directory, or a random workload (offline-mixed)"
            )
    workload = make_workload(
        args.workload,
        num_requests=args.num_requests,
        vocab_size=spec.vocab_size,
        model_dir=model_dir,
    )
    prompts = [r.prompt_token_ids for r in workload.requests]
    params = [
        SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
        for r in workload.requests
    ]
    with tempfile.TemporaryDirectory() as tmp:
        loras = []
        for i in range(args.num_adapters + 1):  # (the last for the load test)
            write_adapter(Path(tmp) / f"a{i}", spec, args.rank, seed=i, dense_mlp=dense_mlp)
            loras.append(LoRARequest(f"a{i}", i + 1, str(Path(tmp) / f"a{i}")))
        mixed = [loras[i % args.num_adapters] for i in range(len(prompts))]
        # warm-up: a whole pass of each (the first touches every page and bucket)
        one_pass(plain, prompts, params, None)
        one_pass(llm, prompts, params, mixed)
        rounds = []
        print(
            f"{workload.name}, {len(prompts)} requests, {args.num_adapters} adapters of rank "
            f"{args.rank}; output tok/s and the ratio to `off` of the round"
        )
        passes = {"off": (plain, None), "base": (llm, None), "mixed": (llm, mixed)}
        for r in range(args.repeats):
            # in turns, every other round backwards: a machine slowing or speeding up over a
            # round (other tenants' memory traffic) does not favour the pass that runs first
            order = list(passes) if r % 2 == 0 else list(reversed(passes))
            got = {n: one_pass(passes[n][0], prompts, params, passes[n][1]) for n in order}
            off, base, mix = got["off"], got["base"], got["mixed"]
            rounds.append({"off": off, "base": base, "mixed": mix})
            print(
                f"round {r}: off {off['tok_s']:7.1f}  base {base['tok_s']:7.1f} "
                f"({base['tok_s'] / off['tok_s']:.3f}x)  mixed {mix['tok_s']:7.1f} "
                f"({mix['tok_s'] / off['tok_s']:.3f}x)"
            )
        ratios = {
            k: statistics.median(x[k]["tok_s"] / x["off"]["tok_s"] for x in rounds)
            for k in ("base", "mixed")
        }
        print(f"median ratios: base {ratios['base']:.3f}x, mixed {ratios['mixed']:.3f}x of off")
        load = load_while_serving(llm, loras[-1], spec.vocab_size)
    control = load["control"]
    print(
        f"load while serving: step median {load['median_step_ms']:.1f} ms, the add's step "
        f"{load['added_step_ms']:.1f}, slowest {load['max_step_ms']:.1f} "
        f"({load['max_over_median']:.2f}x the median, {load['max_over_control']:.2f}x the "
        f"slowest when a base request arrives instead: {control['max_step_ms']:.1f} ms, "
        f"{control['max_over_median']:.2f}x its median); {load['traced']} programs traced; "
        f"the new adapter's request {'answered' if load['answered'] else 'NOT answered'}"
    )
    record |= dict(
        workload=workload.summary(),
        num_adapters=args.num_adapters,
        rank=args.rank,
        rounds=rounds,
        median_ratios=ratios,
        load=load,
    )
