"""GPU compile targets for deviceless (AOT) compiles: XLA's device descriptions, as text.

jax compiles for a GPU that is not present when handed a `GpuTargetConfigProto` in text form
(`jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...)`); it
needs the CUDA plugin (`pip install "jax[cuda12]"`), never a device. The H100 SXM text below
is XLA's own description of that card (xla/tools/hlo_opt/gpu_specs/h100_sxm.txtpb, openxla/xla,
Apache-2.0): the compiler reads the shared-memory limit, SM count and compute capability
(sm_90a) from it. The kernels' tuning (tuning.py) uses the same
two numbers; a test checks they agree.

Kept here, beside the kernels and importing nothing from jaxcb, so kernel tests and jaxcb's
AOT compile (jaxcb/runtime) can share one copy.
"""

from __future__ import annotations

import importlib.util
import re

#: XLA's H100 SXM 80GB device description (GpuTargetConfigProto text format).
H100_SXM_TARGET_CONFIG = """\
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84978434048
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
device_description_str: "NVIDIA H100 80GB HBM3"
"""


def target_config_field(target_config: str, name: str) -> float:
    """A numeric field of a target config text, e.g. "shared_memory_per_block_optin"."""
    match = re.search(rf"^\s*{re.escape(name)}:\s*([0-9.]+)\s*$", target_config, re.MULTILINE)
    if match is None:
        raise ValueError(f"target config has no numeric field {name!r}")
    value = float(match.group(1))
    return int(value) if value.is_integer() else value


def gpu_topology(target_config: str = H100_SXM_TARGET_CONFIG, topology: str = "1x1x1"):
    """Compile-only devices of an absent GPU (`topology`: partitions x hosts x GPUs).

    Raises whatever jax raises when the CUDA plugin is missing; callers that may run without
    it check `cuda_plugin_installed()` first.
    """
    from jax.experimental import topologies

    return topologies.get_topology_desc(
        platform="cuda", target_config=target_config, topology=topology
    )


def cuda_plugin_installed() -> bool:
    """Whether jax's CUDA plugin (jax[cuda12]) is importable: needed to compile for a GPU."""
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:  # no jax_plugins namespace at all
        return False


__all__ = [
    "H100_SXM_TARGET_CONFIG",
    "cuda_plugin_installed",
    "gpu_topology",
    "target_config_field",
]
