"""Simulate request routing over many replicas: prefix affinity vs least-loaded vs round-robin.

    python -m jaxcb.bench simulate_routing                  # 64 replicas, 20,000 requests
    python -m jaxcb.bench simulate_routing --num-replicas 8 --num-requests 2000 --rate 30

A synthetic trace (Poisson arrivals; requests drawn from --num-groups shared prefixes of
--prefix-len tokens with Zipf(--zipf-s) popularity, own tokens and output lengths uniform) is
routed by the policies of jaxcb/server/router.py over a replica model: --slots requests at
once each, FIFO, service = prefill (--prefill-ms-per-token per prompt token not in the
replica's LRU prefix cache of --cache-prefixes prefixes) + decode (--decode-ms-per-token per
output token). Prints each policy's token hit rate, queueing delay and TTFT (mean, p99) and
how evenly requests spread (jaxcb/bench/routing_sim.py has the model's details and limits);
--json writes them.
"""

from __future__ import annotations

import argparse
from typing import Any

from jaxcb.bench.commands import UsageError
from jaxcb.bench.routing_sim import SimConfig, simulate, synthetic_trace
from jaxcb.server.router import POLICIES

DESCRIPTION = "the router's policies over many simulated replicas: hit rate, queueing, TTFT"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-replicas", type=int, default=64)
    p.add_argument("--num-requests", type=int, default=20000)
    p.add_argument("--rate", type=float, default=250.0, help="requests/s (%(default)s)")
    p.add_argument("--num-groups", type=int, default=2000, help="shared prefixes (%(default)s)")
    p.add_argument("--zipf-s", type=float, default=1.1, help="popularity skew (%(default)s)")
    p.add_argument("--prefix-len", type=int, default=1024, help="tokens (%(default)s)")
    p.add_argument("--own-len", type=int, nargs=2, default=[32, 256], metavar=("LO", "HI"))
    p.add_argument("--output-len", type=int, nargs=2, default=[32, 256], metavar=("LO", "HI"))
    p.add_argument("--slots", type=int, default=8, help="requests at once per replica (8)")
    p.add_argument("--cache-prefixes", type=int, default=32, help="prefixes cached (32)")
    p.add_argument("--prefill-ms-per-token", type=float, default=0.2)
    p.add_argument("--decode-ms-per-token", type=float, default=10.0)
    p.add_argument(
        "--max-imbalance",
        type=int,
        default=2,
        help="prefix routing leaves a replica this many requests above the least-loaded "
        "(2 here: with a Zipf-skewed trace, 8 (serve_replicas.py's default) lets hot "
        "prefixes queue behind full slots)",
    )
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    p.add_argument("--seed", type=int, default=0)


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.num_replicas < 1 or args.slots < 1 or args.cache_prefixes < 0:
        p.error("--num-replicas and --slots must be >= 1, --cache-prefixes >= 0")


def run(args: argparse.Namespace, record: dict[str, Any]) -> None:
    try:
        trace = synthetic_trace(
            args.num_requests,
            rate=args.rate,
            num_groups=args.num_groups,
            zipf_s=args.zipf_s,
            own_len=tuple(args.own_len),
            output_len=tuple(args.output_len),
            seed=args.seed,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    config = SimConfig(
        num_replicas=args.num_replicas,
        slots=args.slots,
        prefix_len=args.prefix_len,
        cache_prefixes=args.cache_prefixes,
        prefill_s_per_token=args.prefill_ms_per_token / 1000,
        decode_s_per_token=args.decode_ms_per_token / 1000,
        max_imbalance=args.max_imbalance,
    )
    results = {policy: simulate(trace, policy, config) for policy in args.policies}
    record["results"] = results
    print(f"{args.num_requests} requests at {args.rate:g}/s over {args.num_replicas} replicas, "
          f"{args.num_groups} prefix groups of {args.prefix_len} tokens")  # fmt: skip
    print(f"{'policy':<14}{'hit rate':>9}{'queue mean':>12}{'queue p99':>11}"
          f"{'TTFT mean':>11}{'TTFT p99':>10}{'req/replica':>13}")  # fmt: skip
    for policy, r in results.items():
        spread = f"{r['routed_min']:.0f}-{r['routed_max']:.0f}"
        print(f"{policy:<14}{r['hit_rate']:>9.1%}{r['queue_mean_s'] * 1e3:>10.1f}ms"
              f"{r['queue_p99_s'] * 1e3:>9.1f}ms{r['ttft_mean_s'] * 1e3:>9.1f}ms"
              f"{r['ttft_p99_s'] * 1e3:>8.1f}ms{spread:>13}")  # fmt: skip
