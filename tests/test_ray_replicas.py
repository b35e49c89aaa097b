"""Serving replicas placed by Ray (jaxcb/ray_replicas.py, serve_replicas.py --ray): two
servers owned by actors of a private local cluster on loopback answer through the router's
addresses; a replica whose server dies is replaced by a new actor, and the router's Replica
gets its new address."""

from __future__ import annotations

import json
import urllib.request

import pytest

pytest.importorskip("ray")

from jaxcb.ray_replicas import RayReplicas
from jaxcb.server.router import Router

SERVE_ARGS = [  # the built-in tiny model, one small bucket
    "--model", "jaxcb-tiny-random-llama-v1", "--max-num-seqs", "2",
    "--max-num-batched-tokens", "16", "--token-buckets", "16", "--max-model-len", "64",
    "--num-pages", "16",
]  # fmt: skip


def complete(host: str, port: int) -> dict:
    body = json.dumps({"prompt": [1, 5, 9], "max_tokens": 3, "temperature": 0}).encode()
    request = urllib.request.Request(
        f"http://{host}:{port}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_ray_replicas_answer_and_a_dead_one_is_replaced() -> None:
    replicas = RayReplicas(2, SERVE_ARGS)
    try:
        replicas.wait_healthy(240)
        assert all(host == "127.0.0.1" for host, _ in replicas.addresses)  # loopback only
        router = Router(replicas.addresses, policy="round-robin")
        replicas.router_replicas = router.replicas
        outs = [complete(*address) for address in replicas.addresses]
        assert outs[0]["choices"][0]["text"] == outs[1]["choices"][0]["text"]
        old = replicas.addresses[1]
        replicas._ray.get(replicas.actors[1].stop.remote())  # its server dies
        replicas.restart_if_exited(1)
        assert replicas.restarts == 1 and replicas.addresses[1] != old
        assert (router.replicas[1].host, router.replicas[1].port) == replicas.addresses[1]
        replicas.wait_healthy(240)
        assert (
            complete(*replicas.addresses[1])["choices"][0]["text"] == outs[0]["choices"][0]["text"]
        )
        replicas.restart_if_exited(0)  # alive: left alone
        assert replicas.restarts == 1
    finally:
        replicas.stop()
