"""Speculative decoding against decoding one token a step: jaxcb with `speculative_config`
off and on, and llama.cpp's own tool on the same weights, request by request, taking turns.

Single stream (the default): the workload's requests one at a time (default `grounded`:
copy, quote, correct or rewrite a passage; greedy to the end of the turn, at most
--max-tokens). For each request, each system in turn:

  jaxcb off        an engine without speculation (async scheduling, as the preset)
  jaxcb <method>   an engine with --speculative-config (default n-gram, 4 tokens)
  llama-lookup     with --llama-lookup BIN and --llama-gguf FILE: llama.cpp's prompt-lookup
                   example (`-n --max-tokens --temp 0 -t 2 --spec-draft-n-max K`) on the
                   request's chat-templated text; its "decoded N tokens in S seconds"
  llama-speculative  with --llama-speculative BIN, --llama-gguf FILE and --llama-draft-gguf
                   DRAFT: llama.cpp's draft-model example, the same way (`-md DRAFT -td 2`)

Decode tok/s is tokens after the first over the seconds from the first token to the last
(prefill excluded: llama-lookup's own figure is that); the table sums them over the
requests. jaxcb's greedy outputs with and without speculation must be the same tokens: the
count of requests that differ is printed (0 expected), with the proposals' acceptance.

--concurrent N: instead, N requests of the workload at once through LLM.generate, off and on
in turns for --repeats rounds: output tokens per second of each, and on over off (the
turn-down at work: speculation should cost a large batch nothing).

    python -m jaxcb.bench speculative --model smollm2-135m --dtype bfloat16 \\
        --llama-lookup <llama.cpp>/build/bin/llama-lookup --llama-gguf SmolLM2-BF16.gguf
    python -m jaxcb.bench speculative --model smollm2-135m --dtype bfloat16 \\
        --workload chat-natural --speculative-config '{"model": "Q4_0.gguf", \\
        "quantization": "int8"}' --llama-speculative <llama.cpp>/build/bin/llama-speculative \\
        --llama-gguf SmolLM2-BF16.gguf --llama-draft-gguf Q4_0.gguf
    python -m jaxcb.bench speculative --model smollm2-135m --dtype bfloat16 \\
        --workload chat-fixed --concurrent 64
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from jaxcb.bench.cli import (
    OWN_FIELDS,
    add_config_overrides,
    add_workload_args,
    config_overrides,
    load_model_and_workload,
    make_log,
)
from jaxcb.bench.commands import SharedFlags
from jaxcb.config import EngineConfig, SpeculativeConfig

DESCRIPTION = "speculative decoding on and off, single stream or a batch, and llama-lookup"
FLAGS = SharedFlags(
    repeats=3,
    repeats_help="--concurrent: rounds of each mode, in turns",
    model=True,
    default_model="smollm2-135m",
    dtype="bfloat16",
    config=True,
)

log = make_log()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser, default_workload="grounded")
    parser.add_argument(
        "--speculative-config",
        type=json.loads,
        default={"method": "ngram", "num_speculative_tokens": 4},
        help="the 'on' engine's speculative_config, JSON (%(default)s)",
    )
    parser.add_argument("--max-tokens", type=int, default=256, help="cap per request (%(default)s)")
    parser.add_argument(
        "--concurrent", type=int, default=0, help="N requests at once instead (throughput)"
    )
    parser.add_argument("--llama-lookup", type=Path, help="llama.cpp's llama-lookup binary")
    parser.add_argument(
        "--llama-speculative", type=Path, help="llama.cpp's llama-speculative binary"
    )
    parser.add_argument("--llama-gguf", type=Path, help="the GGUF file llama.cpp's tool runs")
    parser.add_argument(
        "--llama-draft-gguf", type=Path, help="the draft GGUF file of --llama-speculative"
    )
    # (the speculative_config fields come in --speculative-config's JSON alone: the off
    # engine takes none of them)
    top = {f.name for f in dataclasses.fields(EngineConfig)}  # (--model, --quantization)
    spec_fields = {f.name for f in dataclasses.fields(SpeculativeConfig)} - top
    add_config_overrides(parser, skip={*OWN_FIELDS, *spec_fields})


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    tool = args.llama_lookup or args.llama_speculative
    if args.llama_lookup and args.llama_speculative:
        parser.error("give --llama-lookup or --llama-speculative, not both")
    if bool(tool) != bool(args.llama_gguf):
        parser.error("--llama-lookup / --llama-speculative and --llama-gguf go together")
    if bool(args.llama_speculative) != bool(args.llama_draft_gguf):
        parser.error("--llama-speculative and --llama-draft-gguf go together")
    for path in (tool, args.llama_gguf, args.llama_draft_gguf):
        if path is not None and not path.is_file():
            parser.error(f"no such file: {path}")
    if args.concurrent and tool:
        parser.error("--concurrent compares jaxcb with itself; llama.cpp's tools are single stream")


def engines(args: argparse.Namespace, needed_len: int) -> dict[str, Any]:
    from jaxcb import LLM

    overrides = config_overrides(args, needed_len, log)
    method = SpeculativeConfig(**args.speculative_config).method
    out = {}
    for name, spec in (("off", {"method": "none"}), (method, args.speculative_config)):
        log(f"building jaxcb {name} ...")
        extra = {} if name == "off" else {"async_scheduling": None}  # (sync: no warning)
        out[name] = LLM(
            str(args.model_dir), config=args.config, **overrides | extra, speculative_config=spec
        )
    return out


def decode_rate(out: Any) -> tuple[int, float]:
    """(tokens after the first, seconds from the first token to the last) of an output."""
    m = out.metrics
    return len(out.outputs[0].token_ids) - 1, m.last_token_time - m.first_token_time


def llama_tool_name(args: argparse.Namespace) -> str | None:
    return (
        "llama-lookup"
        if args.llama_lookup
        else ("llama-speculative" if args.llama_speculative else None)
    )


def llama_tool(args: argparse.Namespace, text: str, draft: int) -> tuple[int, float]:
    """(tokens, seconds) of llama-lookup's or llama-speculative's decode of `text` (its own
    figure)."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(text)
        f.flush()
        binary = args.llama_lookup or args.llama_speculative
        cmd = [str(binary), "-m", str(args.llama_gguf), "-f", f.name]
        cmd += ["-n", str(args.max_tokens), "--temp", "0", "-t", "2", "-c", "4096"]
        cmd += ["--spec-draft-n-max", str(draft)]
        if args.llama_speculative:
            cmd += ["-md", str(args.llama_draft_gguf), "-td", "2"]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", done.stderr + done.stdout)
    if m is None:
        raise RuntimeError(f"{binary.name} printed no 'decoded' line: {done.stderr[-500:]}")
    return int(m.group(1)) - 1, float(m.group(2))


def run(args: argparse.Namespace, record: dict[str, Any]) -> None:
    from jaxcb import SamplingParams

    args.model_dir, _, workload = load_model_and_workload(args)
    requests = workload.requests
    needed = max(len(r.prompt_token_ids) for r in requests) + args.max_tokens
    systems = engines(args, needed)
    stops = list(workload.stop_token_ids or ())

    def params(r: Any) -> SamplingParams:
        cap = min(r.max_tokens, args.max_tokens)
        return SamplingParams(
            max_tokens=cap, temperature=0, ignore_eos=workload.spec.ignore_eos, stop_token_ids=stops
        )

    prompts = [r.prompt_token_ids for r in requests]
    warm = prompts[: max(1, args.warmup_requests)]
    for llm in systems.values():
        llm.generate(warm, [params(r) for r in requests[: len(warm)]], use_tqdm=False)
    if args.concurrent:
        params_all = [params(r) for r in requests]
        record.update(throughput(args, systems, prompts[: args.concurrent], params_all))
        return
    tokenizer = next(iter(systems.values())).engine.tokenizer
    tool = llama_tool_name(args)
    totals = {name: [0, 0.0] for name in [*systems, tool or "llama"]}
    differ = 0
    for i, (prompt, request) in enumerate(zip(prompts, requests, strict=True)):
        outs = {}
        for name, llm in systems.items():
            outs[name] = llm.generate([prompt], params(request), use_tqdm=False)[0]
            n, s = decode_rate(outs[name])
            totals[name][0] += n
            totals[name][1] += s
        tokens = [o.outputs[0].token_ids for o in outs.values()]
        differ += any(t != tokens[0] for t in tokens)
        line = f"request {i + 1}/{len(prompts)}: {len(prompt)} prompt, {len(tokens[0])} out"
        if tool:
            text = tokenizer.decode(prompt, skip_special_tokens=False)
            k = args.speculative_config.get("num_speculative_tokens", 4)
            n, s = llama_tool(args, text, k)
            totals[tool][0] += n
            totals[tool][1] += s
            line += f"; {tool} {n + 1} out"
        log(line)
    rates = {name: n / s for name, (n, s) in totals.items() if s > 0}
    spec_name = list(systems)[1]
    stats = systems[spec_name].stats()["spec_decode"]
    print(f"\n{'system':<16}{'decode tok/s':>14}{'vs off':>9}")
    for name, rate in rates.items():
        print(
            f"{'jaxcb ' + name if name in systems else name:<16}{rate:>14.1f}"
            f"{rate / rates['off']:>8.2f}x"
        )
    if tool in rates:
        print(f"jaxcb {spec_name} / {tool}: {rates[spec_name] / rates[tool]:.2f}x")
    print(f"requests whose tokens differ with speculation: {differ} of {len(prompts)}")
    print(
        f"acceptance: {stats['num_accepted_tokens']} of {stats['num_draft_tokens']} proposed "
        f"tokens kept, {stats['mean_acceptance_length']:.2f} tokens per verified proposal"
    )
    record.update(
        workload=workload.spec.name,
        num_requests=len(prompts),
        decode_tok_s=rates,
        tokens_and_seconds=totals,
        requests_differing=differ,
        spec_decode=stats,
    )


def throughput(
    args: argparse.Namespace, systems: dict[str, Any], prompts: list, params: list
) -> dict[str, Any]:
    """--concurrent: every prompt at once, the engines in turns; output tok/s of each."""
    rounds: dict[str, list[float]] = {name: [] for name in systems}
    differ = 0
    preemptions = {name: llm.stats()["preemptions"] for name, llm in systems.items()}
    for round_ in range(args.repeats):
        tokens = []
        for name, llm in systems.items():
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params[: len(prompts)], use_tqdm=False)
            seconds = time.perf_counter() - t0
            rounds[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / seconds)
            tokens.append([o.outputs[0].token_ids for o in outs])
            log(f"{name} {round_ + 1}/{args.repeats}: {rounds[name][-1]:.1f} output tok/s")
        differ += sum(a != b for a, b in zip(*tokens, strict=True))
    preemptions = {n: llm.stats()["preemptions"] - preemptions[n] for n, llm in systems.items()}
    best = {name: max(v) for name, v in rounds.items()}
    names = list(systems)
    ratio = [a / b for a, b in zip(rounds[names[1]], rounds[names[0]], strict=True)]
    print(f"\n{len(prompts)} requests at once, output tok/s (best of {args.repeats}):")
    for name, value in best.items():
        print(f"  jaxcb {name:<10}{value:>10.1f}")
    print(f"  {names[1]} / off per round: {', '.join(f'{r:.3f}' for r in ratio)}")
    print(
        f"  outputs whose tokens differ: {differ} of {len(prompts) * args.repeats}; "
        f"preemptions: {preemptions}"
    )
    stats = systems[names[1]].stats()["spec_decode"]
    print(
        f"  acceptance: {stats['num_accepted_tokens']} of {stats['num_draft_tokens']} proposed "
        f"tokens kept"
    )
    return dict(
        concurrent=len(prompts),
        output_tok_s=rounds,
        ratio_per_round=ratio,
        outputs_differing=differ,
        preemptions=preemptions,
        spec_decode=stats,
    )
