"""What structured outputs cost: the token mask's share of a step, and the suite's validity.

On the real model (default) with --num-seqs sequences running:

1. free: every request unconstrained (greedy, EOS ignored, --max-tokens each): output tok/s
   and the mean step time at a full batch;
2. constrained: the same number of requests, each under one of the structured-output suite's
   constraints (jaxcb/bench/structured_suite.py, cycled): output tok/s, how many outputs
   satisfy their constraint, grammar compile seconds;
3. the mask's parts, measured apart: on the host, filling the mask rows (llguidance, all rows
   of a step at once on every core) at every position of the constrained outputs, per row,
   times the rows of a step; on the device, the step's
   sampling with a mask against without one ([rows, vocab] logits, jitted, median of
   --repeats calls);
4. mask cost = (host + device) / the free step time;
5. steady: the free run again with every request constrained by a regex no output of
   --max-tokens tokens can complete (`[a-z ]{1000,}`), so all of them run every step as in
   the free run: the whole cost of constraining a full batch, end to end (the mask, the
   logits the LM head then writes instead of its argmax, and steps no longer overlapped
   with the host's work: async scheduling waits for a constrained row's token).
A step without constrained rows sends no mask and skips the masking (`lax.cond` on a flag).

    python -m jaxcb.bench structured                       # SmolLM2, 64 sequences
    python -m jaxcb.bench structured --num-seqs 16 --json out/structured.json
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcb import LLM, SamplingParams
from jaxcb.bench.commands import SharedFlags
from jaxcb.bench.structured_suite import MAX_TOKENS, cases, chat
from jaxcb.bench.timing import median_seconds
from jaxcb.engine.grammar import fill_masks, mask_words
from jaxcb.models.loading.default_model import DEFAULT_NAME
from jaxcb.sampling import sample

#: A regex no output of a few hundred tokens completes: every constrained row runs every step.
STEADY = "[a-z ]{1000,}"

DESCRIPTION = "what structured outputs cost: the token mask's share of a step, the suite's validity"
FLAGS = SharedFlags(
    repeats=20,
    repeats_help="timed calls of the device part",
    repeats_alias="--iters",
    model=True,
    default_model=DEFAULT_NAME,
    model_help="any model jaxcb loads",
    dtype="bfloat16",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-seqs", type=int, default=64, help="requests, all running at once")
    parser.add_argument("--max-tokens", type=int, default=64, help="free requests' output tokens")


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.num_seqs < 1 or args.max_tokens < 1:
        parser.error("--num-seqs and --max-tokens must be >= 1")


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def run_timed(llm: LLM, prompts: list[str], params) -> tuple[list, float, int, int]:
    """(outputs, seconds, steps, output tokens) of a pass after an untimed warm-up pass."""
    llm.generate(prompts, params, use_tqdm=False)
    steps0 = llm.stats()["steps"]
    outs, seconds = timed(lambda: llm.generate(prompts, params, use_tqdm=False))
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return outs, seconds, llm.stats()["steps"] - steps0, tokens


def device_mask_ms(rows: int, vocab: int, iters: int) -> tuple[float, float]:
    """Median ms of the step's sampling over [rows, vocab] logits, greedy, without and with
    a token mask (one allowed id in eight)."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((rows, vocab)).astype(np.float32))
    mask = jnp.asarray(np.full((rows, mask_words(vocab)), 0x11111111, np.int32))
    zeros_i, zeros_f = jnp.zeros(rows, jnp.int32), jnp.zeros(rows, jnp.float32)
    common = dict(
        temperature=zeros_f,
        top_k=zeros_i,
        top_p=jnp.ones(rows),
        min_p=zeros_f,
        rng_keys=jnp.zeros((rows, 2), jnp.uint32),
        sample_counters=zeros_i,
        penalty_args=(  # no history (the step's padding rows)
            jnp.full((rows, 1), 1 << 30, jnp.int32),
            jnp.zeros((rows, 1), jnp.float32),
            zeros_f,
            zeros_f,
            jnp.ones(rows),
        ),
        num_top_logprobs=0,
    )

    def run(flag: bool) -> float:
        flags = jnp.zeros(6, jnp.int32)

        @jax.jit
        def f(x, m):
            return sample(x, flags=flags, token_mask=m, any_mask=jnp.bool_(flag), **common)

        return median_seconds(f, (logits, mask), iters, warmup=0) * 1e3

    return run(False), run(True)


def run(args: argparse.Namespace, record: dict[str, Any]) -> None:
    n = args.num_seqs
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=n, max_model_len=512)
    tok = llm.tokenizer
    suite = [cases()[i % len(cases())] for i in range(n)]
    prompts = [
        tok.apply_chat_template(chat(c.prompt), tokenize=False, add_generation_prompt=True)
        for c in suite
    ]
    free = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    _, free_s, free_steps, free_tokens = run_timed(llm, prompts, free)
    step_ms = free_s / free_steps * 1e3

    params = [
        SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.0, structured_outputs=c.structured_outputs
        )
        for c in suite
    ]
    llm.generate(prompts, params, use_tqdm=False)  # warm-up (grammars compiled, then cached)
    compiled = llm.stats()
    outs, cons_s = timed(lambda: llm.generate(prompts, params, use_tqdm=False))
    samples = [o.outputs[0] for o in outs]
    cons_tokens = sum(len(s.token_ids) for s in samples)
    valid = sum(c.check(s.text) is None for c, s in zip(suite, samples, strict=True))

    steady = SamplingParams(
        max_tokens=args.max_tokens, temperature=0.0, structured_outputs={"regex": STEADY}
    )
    _, steady_s, steady_steps, steady_tokens = run_timed(llm, prompts, steady)
    steady_ms = steady_s / steady_steps * 1e3

    # the host part: the step's mask rows at every position of the constrained outputs,
    # filled as the packer fills them (all rows of a step at once, on every core)
    grammars = llm.engine.grammars
    matchers = []
    for case in suite:
        so = SamplingParams(structured_outputs=case.structured_outputs).structured_outputs
        matchers.append(grammars.matcher(grammars.compile(so)))
    mask = np.zeros((n, mask_words(llm.engine.info.vocab_size)), np.int32)
    fill_seconds, num_rows = 0.0, 0
    for k in range(max(len(s.token_ids) for s in samples)):
        rows = [(i, m) for i, m in enumerate(matchers) if k < len(samples[i].token_ids)]
        t0 = time.perf_counter()
        fill_masks(rows, mask)
        fill_seconds += time.perf_counter() - t0
        num_rows += len(rows)
        for i, m in rows:
            m.accept(samples[i].token_ids[k])
    host_ms = fill_seconds / num_rows * 1e3 * n  # a step of n constrained rows
    plain_ms, masked_ms = device_mask_ms(n, llm.engine.info.vocab_size, args.repeats)
    device_ms = max(masked_ms - plain_ms, 0.0)
    result = dict(
        device=jax.devices()[0].device_kind,
        num_seqs=n,
        free=dict(seconds=free_s, tokens=free_tokens, steps=free_steps, step_ms=step_ms,
                  output_tok_s=free_tokens / free_s),
        constrained=dict(seconds=cons_s, tokens=cons_tokens, output_tok_s=cons_tokens / cons_s,
                         valid=valid, total=n,
                         grammars_compiled=compiled["grammars_compiled"],
                         grammar_compile_seconds=compiled["grammar_compile_seconds"]),
        steady=dict(seconds=steady_s, tokens=steady_tokens, steps=steady_steps,
                    step_ms=steady_ms, overhead=steady_ms / step_ms - 1),
        mask=dict(host_ms_per_step=host_ms, host_us_per_row=fill_seconds / num_rows * 1e6,
                  device_ms_plain=plain_ms, device_ms_masked=masked_ms,
                  device_ms_per_step=device_ms, fraction_of_step=(host_ms + device_ms) / step_ms),
    )  # fmt: skip
    print(f"device: {result['device']}, {n} sequences, model {args.model}")
    f, c, m = result["free"], result["constrained"], result["mask"]
    print(
        f"free:        {f['output_tok_s']:8.1f} out tok/s, {f['steps']} steps, "
        f"{step_ms:.2f} ms/step"
    )
    compile_ms = c["grammar_compile_seconds"] * 1e3
    print(f"constrained: {c['output_tok_s']:8.1f} out tok/s, {valid}/{n} outputs valid, "
          f"{c['grammars_compiled']} grammars compiled in {compile_ms:.1f} ms")  # fmt: skip
    print(f"mask: host {m['host_ms_per_step']:.3f} ms/step ({m['host_us_per_row']:.1f} us a row), "
          f"device {device_ms:.3f} ms/step ({plain_ms:.3f} -> {masked_ms:.3f}): "
          f"{100 * m['fraction_of_step']:.1f}% of a free step")  # fmt: skip
    st = result["steady"]
    print(f"steady:      {steady_tokens / steady_s:8.1f} out tok/s, {steady_steps} steps, "
          f"{steady_ms:.2f} ms/step: +{100 * st['overhead']:.1f}% over a free step")  # fmt: skip
    record |= result
