"""Tensor and data parallelism on 8 forced CPU devices: same greedy tokens as one device,
the KV pool and params sharded as the rules in runtime/sharding.py say, orbax restored into
a tensor-parallel mesh, and clear errors for sizes that cannot work.

Everything runs in one subprocess (multidevice_worker.py): the device count is fixed once
jax's backend starts, and this process has one device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("multidevice_worker.py")


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("multidevice")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, str(WORKER), str(work)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-6000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


RUNS = ["tp2", "tp4", "tp2-xla", "tp4-xla", "dp2", "dp2-tp2", "orbax-tp2"]


def test_eight_devices(report: dict) -> None:
    assert report["num_devices"] == 8


def test_reference_output_is_diverse(report: dict) -> None:
    tokens = report["tp1"]["tokens"]
    assert all(len(set(t)) > 3 for t in tokens), tokens  # not one repeated token


@pytest.mark.parametrize("name", RUNS)
def test_same_tokens_as_one_device(report: dict, name: str) -> None:
    assert report[name]["tokens"] == report["tp1"]["tokens"]


def test_int8_weights_split_like_their_float_weights(report: dict) -> None:
    """int8 weights (models/quant.py) under TP 2: the same tokens as on one device, the
    int8 values and their group scales split along the weight's own axes."""
    assert report["int8-tp2"]["tokens"] == report["int8"]["tokens"]
    (replica,) = report["int8-tp2"]["replicas"]
    params = replica["params"]
    for name in ("wqkv", "wo", "w_gate_up", "w_down"):
        assert params[name]["q"] == params[name]["scale"] == params[name]["min"], name
    # (after the layer axis of the stack, never sharded)
    assert params["wqkv"]["q"] == [None, None, "tensor", None, None]  # by KV head
    assert params["wo"]["q"] == [None, "tensor", None]  # by input (query heads): whole groups


def test_quantized_kv_pages_and_scales_split_by_kv_head(report: dict) -> None:
    """int8 KV pages (kv_cache_dtype) under TP 2: the same tokens as on one device, the
    pages and their scales split by KV head."""
    assert report["int8kv-tp2"]["tokens"] == report["int8kv"]["tokens"]
    (replica,) = report["int8kv-tp2"]["replicas"]
    assert replica["kv_spec"] == ["tensor", None, None, None]
    assert replica["kv_scales_spec"] == ["tensor", None, None]
    assert report["tp1"]["replicas"][0]["kv_scales_spec"] is None


@pytest.mark.parametrize("name", RUNS)
def test_same_prompt_logprobs_as_one_device(report: dict, name: str) -> None:
    (want,) = report["tp1"]["prompt_logprobs"]
    (got,) = report[name]["prompt_logprobs"]
    assert len(want) >= 99 * 2  # 99 entries: the prompt token and its top 2 (1 if in them)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert [lp for _, lp in got] == pytest.approx([lp for _, lp in want], abs=1e-4)


@pytest.mark.parametrize(("name", "tp"), [("tp2", 2), ("tp4", 4), ("tp4-xla", 4)])
def test_kv_pool_is_sharded_by_kv_head(report: dict, name: str, tp: int) -> None:
    (replica,) = report[name]["replicas"]
    pages = 64 * replica["num_layers"]  # every layer's 64 pages in one array
    assert replica["kv_shape"] == [4, pages, 16, 16]  # [Hkv, L * P, page_size, D]
    assert replica["kv_spec"] == ["tensor", None, None, None]
    assert replica["kv_shard_shapes"] == [[4 // tp, pages, 16, 16]] * tp
    assert len(replica["devices"]) == tp


def test_params_follow_the_logical_rules(report: dict) -> None:
    params = report["tp2"]["replicas"][0]["params"]
    assert params == {
        "embed": ["tensor", None],  # vocab
        "lm_head": [None, "tensor"],  # vocab
        # layer weights stacked [L, ...]: the layer axis is never sharded
        "wqkv": [None, None, "tensor", None, None],  # KV heads
        "wo": [None, "tensor", None],  # query heads
        "w_gate_up": [None, None, None, "tensor"],  # MLP intermediate
        "w_down": [None, "tensor", None],
        "attn_norm": [None, None],
    }


def test_one_device_is_unsharded(report: dict) -> None:
    (replica,) = report["tp1"]["replicas"]
    assert replica["kv_shard_shapes"] == [replica["kv_shape"]]


@pytest.mark.parametrize(("name", "tp"), [("dp2", 1), ("dp2-tp2", 2)])
def test_data_parallel_replicas_own_disjoint_devices(report: dict, name: str, tp: int) -> None:
    replicas = report[name]["replicas"]
    assert len(replicas) == 2
    devices = [r["devices"] for r in replicas]
    assert all(len(d) == tp for d in devices) and not set(devices[0]) & set(devices[1])
    # least-loaded routing: the 6 prompts are spread evenly
    assert [r["requests"] for r in replicas] == [3, 3]
    assert report[name]["prefill_budget"] == 64  # max_num_batched_tokens, not 2 x 64


def test_server_spreads_requests_over_replicas(report: dict) -> None:
    server = report["dp2"]["server"]
    assert server["status"] == 200 and server["kv_usage_metric"]
    assert server["tokens"] == server["offline_tokens"]
    # 4 prompts arrive together; then each replica also runs the offline generate of them
    assert server["requests_per_replica"] == [4, 4]


def test_orbax_restores_straight_into_the_mesh(report: dict) -> None:
    restored = report["orbax_restored"]
    assert restored["format"] == "orbax" and restored["is_jax_array"]
    assert restored["wqkv_spec"] == [None, "tensor", None, None]
    assert len(restored["wqkv_devices"]) == 2


def test_sizes_that_cannot_work_are_clear_errors(report: dict) -> None:
    errors = report["errors"]
    assert "tensor_parallel_size=8 does not divide" in errors["tp8"]
    assert "num_key_value_heads=4" in errors["tp8"] and "valid sizes: [1, 2, 4]" in errors["tp8"]
    assert "needs 16 devices" in errors["tp16"]
    assert "needs 12 devices" in errors["dp3-tp4"]
