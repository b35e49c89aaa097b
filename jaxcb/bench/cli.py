"""Flags and set-up the offline benchmark scripts share (bench_offline, compare_batching,
sweep_buckets): model, workload, dtype, jaxcb preset and one flag per jaxcb config field."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from jaxcb.bench.workloads import WORKLOADS, Workload, make_workload
from jaxcb.config import EngineConfig, flat_fields

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "bench-cpu.yaml"
#: Config fields the scripts set themselves (or have their own flag for).
OWN_FIELDS = ("model", "dtype")


def make_log() -> Callable[[str], None]:
    """A logger to stderr that stamps seconds since it was made."""
    t0 = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f}s] {message}", file=sys.stderr, flush=True)

    return log


def add_workload_args(parser: argparse.ArgumentParser, *, default_workload: str) -> None:
    parser.add_argument("--model", type=Path, help="Hugging Face model dir (default: bench-57m)")
    parser.add_argument(
        "--workload",
        default=default_workload,
        choices=sorted(WORKLOADS),
        help="; ".join(f"{w.name}: {w.description}" for w in WORKLOADS.values()),
    )
    parser.add_argument(
        "--num-requests", type=int, help="serve only the first N requests (quick runs)"
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="weights/activations (%(default)s)",
    )
    parser.add_argument(
        "--warmup-requests",
        type=int,
        default=4,
        help="first N requests served untimed before timing (%(default)s)",
    )
    parser.add_argument(
        "--config", type=Path, default=DEFAULT_CONFIG, help="jaxcb YAML preset (%(default)s)"
    )


def add_config_overrides(parser: argparse.ArgumentParser, skip: Iterable[str] = OWN_FIELDS) -> None:
    """One `--field-name V` per EngineConfig field (dest `cfg_<field>`), overriding the preset."""
    group = parser.add_argument_group(
        "jaxcb config overrides", "any EngineConfig field; given ones replace the preset's"
    )
    for name, (section, f) in flat_fields().items():
        if name in skip:
            continue
        kind = str(f.type).replace("tuple[int, ...]", "comma list of int").replace(" | None", "")
        group.add_argument(
            f"--{name.replace('_', '-')}",
            dest=f"cfg_{name}",
            metavar="V",
            help=f"{section or 'engine'}.{name} ({kind})",
        )


def config_overrides(
    args: argparse.Namespace,
    needed_len: int,
    log: Callable[[str], None],
    base: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Flat config overrides: `base`, then the flags, plus a max_model_len that fits the
    workload."""
    overrides = dict(base or {})
    overrides |= {k[4:]: v for k, v in vars(args).items() if k.startswith("cfg_") and v is not None}
    overrides["dtype"] = args.dtype
    config = EngineConfig.from_yaml(args.config, **overrides)  # fails early on a bad value
    if config.max_model_len is not None and config.max_model_len < needed_len:
        page = config.cache.page_size
        overrides["max_model_len"] = -(-needed_len // page) * page
        log(
            f"max_model_len {config.max_model_len} < {needed_len} the workload needs: using "
            f"{overrides['max_model_len']} (pass --max-model-len to choose)"
        )
    return overrides


def load_model_and_workload(args: argparse.Namespace) -> tuple[Path, Any, Workload]:
    """The model dir (bench-57m unless --model), its ModelSpec, and the drawn workload."""
    from jaxcb.bench.models import bench_model_dir
    from jaxcb.models.loader import read_hf_config, spec_from_hf_config

    model_dir = Path(args.model or bench_model_dir("bench-57m"))
    spec = spec_from_hf_config(read_hf_config(model_dir))
    workload = make_workload(
        args.workload, num_requests=args.num_requests, vocab_size=spec.vocab_size
    )
    return model_dir, spec, workload


def args_record(args: argparse.Namespace) -> dict[str, Any]:
    """The flags as given, JSON-able (unset config overrides left out)."""
    given = {k: v for k, v in vars(args).items() if not (k.startswith("cfg_") and v is None)}
    return {k: str(v) if isinstance(v, Path) else v for k, v in given.items()}
