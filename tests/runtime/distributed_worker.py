"""One process of a multi-process jax job on this machine (test_distributed.py starts N of
them on a loopback coordinator), or the single-process reference (--processes 1): a tiny
model, tensor parallel over every process's CPU devices, a few requests (greedy, seeded,
unseeded, with logprobs and prompt logprobs) run step by step. Prints one JSON object: the
tokens and logprobs, and a hash of the step inputs this process packed.

    python tests/runtime/distributed_worker.py MODEL --processes 2 --process-id 0 --port P

MODEL: a Hugging Face directory or a jaxcb (orbax) checkpoint.

--fail exit|freeze --fail-after K: this process dies (os._exit) or freezes (SIGSTOP, its
sockets left open, as a hung host) after K steps, for the failure tests.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys

import jax
import numpy as np

ENGINE = dict(
    max_model_len=128,
    page_size=16,
    num_pages=32,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    token_buckets=[32],  # one bucket: one compile per process
    attention="xla",
    matmul="xla",  # as under tensor parallelism (and no native kernel build in a fresh cache)
)


def fingerprint_inputs(runner) -> hashlib._Hash:
    """A hash of every step input this process packs (its schedule, as its devices see it),
    updated as the engine runs: multi-controller SPMD is correct only if all agree."""
    digest = hashlib.sha256()
    prepare = runner.prepare

    def hashed(sched, bucket):
        inp = prepare(sched, bucket)
        for leaf in jax.tree_util.tree_leaves(inp):
            digest.update(np.ascontiguousarray(leaf).tobytes())
        return inp

    runner.prepare = hashed
    return digest


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--devices", type=int, default=1, help="CPU devices per process")
    parser.add_argument("--heartbeat-timeout", type=float, default=60.0)
    parser.add_argument("--max-tokens", type=int, default=10)
    parser.add_argument("--async-scheduling", action="store_true")
    parser.add_argument("--fail", choices=("exit", "freeze"), default=None)
    parser.add_argument("--fail-after", type=int, default=3, help="steps before --fail")
    args = parser.parse_args()
    jax.config.update("jax_num_cpu_devices", args.devices)  # before the backend starts

    from jaxcb import LLM, SamplingParams

    distributed = {}
    if args.processes > 1:
        distributed = dict(
            distributed=True,
            coordinator_address=f"127.0.0.1:{args.port}",
            num_processes=args.processes,
            process_id=args.process_id,
            heartbeat_timeout_s=args.heartbeat_timeout,
        )
    tp = args.processes * args.devices
    llm = LLM(
        args.model,
        tensor_parallel_size=tp,
        async_scheduling=args.async_scheduling,
        **ENGINE,
        **distributed,
    )
    engine = llm.engine
    schedule = fingerprint_inputs(engine.runner)
    n = args.max_tokens
    requests = [
        ([5, 6, 7, 8], SamplingParams(max_tokens=n, temperature=0.0)),
        (list(range(3, 50)), SamplingParams(max_tokens=n, temperature=0.0, prompt_logprobs=2)),
        ([40, 41], SamplingParams(max_tokens=n, temperature=0.8, top_k=20, seed=7)),
        ([9, 10, 11], SamplingParams(max_tokens=n, temperature=0.0, logprobs=1)),
        ([60, 61, 62], SamplingParams(max_tokens=n, temperature=0.9)),  # seeded by the engine
    ]
    ids = [engine.add_request(None, prompt, params) for prompt, params in requests]
    done, steps = {}, 0
    print(f"process {args.process_id}: running", file=sys.stderr, flush=True)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
        if args.fail and steps == args.fail_after:
            print(f"process {args.process_id}: {args.fail} now", file=sys.stderr, flush=True)
            if args.fail == "exit":
                os._exit(3)
            os.kill(os.getpid(), signal.SIGSTOP)
    outs = [done[i] for i in ids]
    report = {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "num_devices": jax.device_count(),
        "schedule": schedule.hexdigest(),  # every process must feed its devices alike
        "tokens": [o.outputs[0].token_ids for o in outs],
        "logprobs": [o.outputs[0].logprobs for o in outs],
        "prompt_logprobs": [
            [sorted(entry.items()) for entry in o.prompt_logprobs[1:]]
            for o in outs
            if o.prompt_logprobs is not None
        ],
    }
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
