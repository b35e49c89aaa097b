"""The sharding rules and the parallel config, on this process's one device (the multi-device
runs are in test_tensor_parallel.py)."""

from __future__ import annotations

import dataclasses

import jax
import pytest
from jax.sharding import PartitionSpec as P

from jaxcb import LLM
from jaxcb.config import EngineConfig, ParallelConfig
from jaxcb.models.loading.default_model import CONFIG
from jaxcb.models.registry import param_infos, spec_from_hf_config
from jaxcb.runtime import sharding

SPEC = spec_from_hf_config(CONFIG)  # the built-in tiny model: 4 query heads, 2 KV heads


def test_every_param_has_logical_axes() -> None:
    for tied, bias, qk_norm in [(False, False, False), (True, True, True)]:
        spec = dataclasses.replace(SPEC, tie_word_embeddings=tied, qkv_bias=bias, qk_norm=qk_norm)
        mesh = sharding.replica_mesh(1)
        shardings = sharding.param_shardings(param_infos(spec), mesh)
        layer = shardings["layers"][0]
        assert layer["wqkv"].spec == P(None, "tensor", None, None)
        assert ("bqkv" in layer) == bias and ("q_norm" in layer) == qk_norm
        assert ("lm_head" in shardings) != tied


def test_logical_specs() -> None:
    assert sharding.logical_spec(sharding.KV_PAGES_AXES) == P("tensor", None, None, None)
    assert sharding.logical_spec(("tokens", "q_heads", "head_dim")) == P(None, "tensor", None)
    with pytest.raises(ValueError, match="no sharding rule for logical axes"):
        sharding.logical_spec(("heads",))


def test_heads_that_do_not_divide_are_an_error() -> None:
    sharding.check_tensor_parallel(SPEC, 2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not divide .*=2"):
        sharding.check_tensor_parallel(SPEC, 4)
    with pytest.raises(ValueError, match="intermediate_size"):
        sharding.check_tensor_parallel(dataclasses.replace(SPEC, intermediate_size=385), 2)


def test_a_vocabulary_that_does_not_divide_is_replicated() -> None:
    assert sharding.rules_for(SPEC, 2)["vocab"] == "tensor"
    assert sharding.rules_for(dataclasses.replace(SPEC, vocab_size=321), 2)["vocab"] is None


def test_more_devices_than_exist_is_an_error() -> None:
    n = jax.device_count()
    with pytest.raises(ValueError, match=f"needs {2 * n} devices"):
        sharding.device_mesh(2, n)
    with pytest.raises(ValueError, match="needs 2 devices"):
        LLM(config="configs/tiny-cpu.yaml", tensor_parallel_size=2 * n)


def test_one_device_mesh() -> None:
    mesh = sharding.replica_mesh(1)
    assert mesh.axis_names == ("tensor",) and mesh.devices.size == 1
    assert mesh.devices.flat[0] == jax.devices()[0]


def test_parallel_config() -> None:
    cfg = EngineConfig.from_dict(None, tensor_parallel_size=4, data_parallel_size=2)
    assert cfg.parallel == ParallelConfig(tensor_parallel_size=4, data_parallel_size=2)
    mesh = EngineConfig.from_dict({"parallel": {"mesh_shape": [2, 4]}}).parallel
    assert (mesh.data_parallel_size, mesh.tensor_parallel_size) == (2, 4)
    assert EngineConfig.from_dict(EngineConfig(parallel=mesh).to_dict()).parallel == mesh
    for bad, match in [
        (dict(tensor_parallel_size=0), "tensor_parallel_size must be >= 1"),
        (dict(data_parallel_size=-1), "data_parallel_size must be >= 1"),
        (dict(mesh_shape=[2]), "mesh_shape must be two sizes"),
        (dict(mesh_shape=[2, 4], tensor_parallel_size=2), "contradicts"),
        (dict(process_id=3, num_processes=2), "process_id must be in"),
    ]:
        with pytest.raises(ValueError, match=match):
            EngineConfig.from_dict(None, **bad)
