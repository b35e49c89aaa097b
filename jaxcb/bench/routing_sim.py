"""A routing simulation: many replicas, a synthetic trace of requests that share prefixes, and
the router's own policies (jaxcb/server/router.py's `Router.choose`) deciding where each goes.
What `python -m jaxcb.bench simulate_routing` runs; what it leaves out is said here.

Trace (`synthetic_trace`): `num_groups` prefix groups (a system prompt, a document, a
conversation so far), each `prefix_len` tokens; group popularity is Zipf(`zipf_s`) (a few
prompts are common, most are rare); each request draws a group, its own tokens uniform in
`own_len` and its output length uniform in `output_len`; arrivals are Poisson at `rate`
requests per second. Seeded: the same arguments give the same trace.

Replica model: `slots` requests run at once (continuous batching, simplified: each slot is an
independent server), FIFO; a request's service time is its prefill, `prefill_s_per_token`
per prompt token not in the replica's prefix cache, plus its decode, `decode_s_per_token`
per output token. The prefix cache holds `cache_prefixes` whole prefixes, least recently
used evicted; it is updated when a request is assigned (requests on a replica start in
assignment order). The router sees each replica's requests in flight (queued + running) at
the arrival, as the real one counts them.

Reported per policy: token hit rate (cached prompt tokens / prompt tokens, jaxcb's
prefix_cache_hits / prefix_cache_queries), queueing delay (start - arrival: mean, p99),
time to first token (queueing + prefill: mean, p99) and the spread of requests over replicas.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from jaxcb.server.router import Router


@dataclass(frozen=True)
class SimRequest:
    arrival: float  # seconds
    group: int
    own_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class SimConfig:
    num_replicas: int = 64
    slots: int = 8
    prefix_len: int = 1024
    cache_prefixes: int = 32
    prefill_s_per_token: float = 0.0002
    decode_s_per_token: float = 0.01
    prefix_tokens: int = 256  # the router's key length (irrelevant to a synthetic key)
    max_imbalance: int = 8


def synthetic_trace(
    num_requests: int,
    *,
    rate: float,
    num_groups: int,
    zipf_s: float = 1.1,
    own_len: tuple[int, int] = (32, 256),
    output_len: tuple[int, int] = (32, 256),
    seed: int = 0,
) -> list[SimRequest]:
    """The module docstring's trace."""
    if num_requests < 1 or rate <= 0 or num_groups < 1:
        raise ValueError("num_requests and num_groups must be >= 1 and rate > 0")
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, num_groups + 1) ** zipf_s
    groups = rng.choice(num_groups, size=num_requests, p=weights / weights.sum())
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=num_requests))
    own = rng.integers(own_len[0], own_len[1] + 1, size=num_requests)
    out = rng.integers(output_len[0], output_len[1] + 1, size=num_requests)
    return [
        SimRequest(float(a), int(g), int(n), int(m))
        for a, g, n, m in zip(arrivals, groups, own, out, strict=True)
    ]


def simulate(trace: list[SimRequest], policy: str, config: SimConfig) -> dict[str, float]:
    """Route `trace` with `policy` over the replica model; the figures of the docstring."""
    router = Router(
        [("sim", i) for i in range(config.num_replicas)],
        policy=policy,
        prefix_tokens=config.prefix_tokens,
        max_imbalance=config.max_imbalance,
    )
    finishes: list[list[float]] = [[] for _ in range(config.num_replicas)]  # heaps: in flight
    slots: list[list[float]] = [[0.0] * config.slots for _ in range(config.num_replicas)]
    caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(config.num_replicas)]
    prompt_tokens = cached_tokens = 0
    waits, ttfts = [], []
    for request in trace:
        now = request.arrival
        for i, heap in enumerate(finishes):
            while heap and heap[0] <= now:
                heapq.heappop(heap)
            router.replicas[i].in_flight = len(heap)
        index = router.choose(f"group-{request.group}")
        router.replicas[index].routed += 1
        cache = caches[index]
        hit = request.group in cache
        cache[request.group] = None
        cache.move_to_end(request.group)
        while len(cache) > config.cache_prefixes:
            cache.popitem(last=False)
        prompt = config.prefix_len + request.own_tokens
        uncached = request.own_tokens + (0 if hit else config.prefix_len)
        prompt_tokens += prompt
        cached_tokens += prompt - uncached
        prefill = uncached * config.prefill_s_per_token
        service = prefill + request.output_tokens * config.decode_s_per_token
        start = max(now, heapq.heappop(slots[index]))
        heapq.heappush(slots[index], start + service)
        heapq.heappush(finishes[index], start + service)
        waits.append(start - now)
        ttfts.append(start - now + prefill)
    routed = [r.routed for r in router.replicas]
    return {
        "hit_rate": cached_tokens / prompt_tokens,
        "queue_mean_s": float(np.mean(waits)),
        "queue_p99_s": float(np.percentile(waits, 99)),
        "ttft_mean_s": float(np.mean(ttfts)),
        "ttft_p99_s": float(np.percentile(ttfts, 99)),
        "routed_min": float(min(routed)),
        "routed_max": float(max(routed)),
    }
