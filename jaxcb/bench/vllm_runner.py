"""vLLM's offline `LLM.generate`, driven pass by pass by jaxcb's benchmark (bench/vllm_system.py).

This file runs in vLLM's own virtual environment, as a subprocess: it imports vllm and the
standard library only, never jaxcb (which is not installed there). jaxcb never depends on vllm.

    <vllm-venv>/bin/python vllm_runner.py --model DIR --dtype float32 --requests FILE

FILE is JSON: {"prompts": [[token ids], ...], "max_tokens": [int, ...], "warmup": k,
"ignore_eos": bool, "stop_token_ids": [int, ...], "prefix_caching": bool} (the last three
default to true, [], true). Every request is greedy, with EOS ignored or stopping at the stop
ids, its prompt given as token ids (`skip_tokenizer_init`, so
a model directory without a tokenizer works). The runner loads the model, serves the first k
requests once untimed, and prints {"event": "ready", ...}; then each "pass" line on stdin
resets the prefix cache (every pass sends the same prompts), times one `generate` over all
requests and prints {"event": "pass", "wall_s": ..., "token_ids": [...]}. "quit" or the end
of stdin stops it. Protocol lines are the only thing on stdout: everything vLLM itself prints
is moved to stderr. The `__main__` guard matters: vLLM spawns its engine process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--requests", required=True, help="JSON file of prompts and max_tokens")
    parser.add_argument("--max-model-len", type=int, default=2048)
    args = parser.parse_args()

    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # from here on, anything written to stdout (vLLM's logs) lands on stderr

    def send(message: dict) -> None:
        protocol.write(json.dumps(message) + "\n")

    import vllm
    from vllm import LLM, SamplingParams

    with open(args.requests) as f:
        spec = json.load(f)
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]
    ignore_eos = bool(spec.get("ignore_eos", True))
    stops = [] if ignore_eos else list(spec.get("stop_token_ids", []))
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=m,
            ignore_eos=ignore_eos,
            stop_token_ids=stops,
            detokenize=False,
        )
        for m in spec["max_tokens"]
    ]
    start = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        skip_tokenizer_init=True,
        enable_prefix_caching=bool(spec.get("prefix_caching", True)),
        seed=0,
    )
    load_s = time.perf_counter() - start
    k = max(1, min(int(spec.get("warmup", 4)), len(prompts)))
    start = time.perf_counter()
    llm.generate(prompts[:k], params[:k], use_tqdm=False)
    warmup_s = time.perf_counter() - start
    send(dict(event="ready", version=vllm.__version__, load_s=load_s, warmup_s=warmup_s))

    for line in sys.stdin:
        command = line.strip()
        if command == "quit":
            break
        if command != "pass":
            send(dict(event="error", message=f"unknown command {command!r}"))
            continue
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall_s = time.perf_counter() - start
        send(
            dict(
                event="pass",
                wall_s=wall_s,
                token_ids=[list(o.outputs[0].token_ids) for o in outputs],
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
