"""Ray, where jaxcb uses it (offline/ray_batch.py's engines in actors, ray_replicas.py's
servers in actors): the import with a one-line error naming the pip command, a local
cluster kept on loopback, and the environment an actor limited to a few cores gets."""

from __future__ import annotations

import contextlib
import os
from typing import Any

RAY_MISSING = 'Ray is not installed: pip install "jaxcb[ray]"'
# environment passed on to the actors when the driver has it set
FORWARDED_ENV = ("JAX_PLATFORMS", "JAXCB_CACHE_DIR", "HF_HOME", "TOKENIZERS_PARALLELISM")

# Ray on Linux resolves 127.0.0.1 to the host's network address and listens there; this
# switch (named for what it does on macOS/Windows) keeps a private local cluster on loopback.
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def import_ray(*, loopback: bool = False) -> Any:
    """The ray module, or a one-line ImportError saying how to install it. `loopback`: a
    local cluster about to start listens on 127.0.0.1 only (the setting is read when ray
    is imported, and by its worker processes, hence the environment and the constant)."""
    if loopback:
        os.environ.setdefault(LOOPBACK_ENV, "0")
    try:
        import ray
    except ImportError:
        raise ImportError(RAY_MISSING) from None
    if loopback and os.environ[LOOPBACK_ENV] == "0":
        with contextlib.suppress(ImportError, AttributeError):  # ray imported before
            from ray._private import ray_constants

            ray_constants.ENABLE_RAY_CLUSTER = False
    return ray


def actor_env(num_cpus: int) -> dict[str, str]:
    """Environment of an actor limited to `num_cpus` cores: XLA's and OpenMP's thread pools
    sized to its share, so N actors on one host do not each start a pool per core."""
    env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
    threads = str(max(1, num_cpus))
    flags = os.environ.get("XLA_FLAGS", "")
    flags = " ".join(f for f in flags.split() if "force_host_platform_device_count" not in f)
    if num_cpus <= 1:
        flags += " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    env.update(XLA_FLAGS=flags.strip(), OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
    return env
