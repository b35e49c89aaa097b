"""Flags and set-up the benchmarks that serve a workload in-process share (offline,
compare_batching, sweep_buckets, single_stream, profile, scheduling): the model presets and
their jaxcb presets, the workload, one flag per jaxcb config field, llama.cpp's flags; and
the records every benchmark's --json holds (the machine, the flags)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from jaxcb.bench.workloads import WORKLOADS, Workload, make_workload
from jaxcb.config import EngineConfig, flat_fields

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
DEFAULT_CONFIG = CONFIGS / "bench-cpu.yaml"
#: model preset -> its jaxcb preset when --config is not given (else DEFAULT_CONFIG)
MODEL_CONFIGS = {"smollm2-135m": CONFIGS / "bench-smollm2-cpu.yaml"}
#: Config fields the benchmarks set themselves (or have their own flag for).
OWN_FIELDS = ("model", "dtype")
#: --model and --config as the benchmarks that take a preset say them.
MODEL_HELP = (
    "a preset (bench-57m: Llama-shaped random weights; smollm2-135m: the real model; built "
    "on first use) or a Hugging Face model dir"
)
CONFIG_HELP = (
    f"jaxcb YAML preset (default: {DEFAULT_CONFIG.name}; "
    f"{MODEL_CONFIGS['smollm2-135m'].name} for smollm2-135m)"
)


def make_log() -> Callable[[str], None]:
    """A logger to stderr that stamps seconds since it was made."""
    t0 = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f}s] {message}", file=sys.stderr, flush=True)

    return log


def add_workload_args(
    parser: argparse.ArgumentParser, *, default_workload: str, jaxcb_model: bool = False
) -> None:
    """--workload and the like (--model, --dtype and --config are the family's shared flags);
    `jaxcb_model`: also --jaxcb-model (benchmarks whose jaxcb system honours it)."""
    if jaxcb_model:
        parser.add_argument(
            "--jaxcb-model",
            help="what jaxcb loads instead of --model's directory (the workload still comes "
            "from --model): e.g. the GGUF file llama.cpp runs, to compare both on the same "
            "weights (with --quantization int8, its Q8_0 / Q4 blocks as they are)",
        )
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
        "--warmup-requests",
        type=int,
        default=4,
        help="first N requests served untimed before timing (%(default)s)",
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


def resolve_model(model: str | Path | None) -> Path:
    """A preset's directory (built on first use), or the given model dir."""
    from jaxcb.bench.models import MODEL_PRESETS, bench_model_dir

    if model is None or str(model) in MODEL_PRESETS:
        return bench_model_dir(str(model or "bench-57m"))
    return Path(model)


def load_model_and_workload(args: argparse.Namespace) -> tuple[Path, Any, Workload]:
    """The model dir (bench-57m unless --model), its ModelSpec, and the drawn workload; fills
    in `args.config` (the model's preset) if it was not given."""
    from jaxcb.models.loading.loader import read_hf_config, spec_from_hf_config

    if args.config is None:
        args.config = MODEL_CONFIGS.get(str(args.model), DEFAULT_CONFIG)
    model_dir = resolve_model(args.model)
    spec = spec_from_hf_config(read_hf_config(model_dir))
    workload = make_workload(
        args.workload,
        num_requests=args.num_requests,
        vocab_size=spec.vocab_size,
        model_dir=model_dir,
    )
    return model_dir, spec, workload


def machine_record() -> dict[str, Any]:
    """The CPU a figure was taken on (model, the flags that pick jaxcb's kernels) and the ISA
    level jaxcb's native kernels ran at: every benchmark prints it and stores it in its JSON."""
    from jaxcb.native import build

    flags = build.cpu_flags()
    record = {
        "cpu": build.cpu_model(),
        "flags": [f for f in build.RELEVANT_FLAGS if f in flags],
        "isa_level": build.active_level(),
        "isa_cap": build.isa_cap(),
        "cores": os.cpu_count(),
    }
    print(
        f"machine: {build.cpu_summary()}, {record['cores']} cores; jaxcb's native kernels at "
        f"{record['isa_level']}"
        + (f" ({build.ISA_ENV}={record['isa_cap']})" if record["isa_cap"] else ""),
        flush=True,
    )
    return record


def args_record(args: argparse.Namespace) -> dict[str, Any]:
    """The flags as given, JSON-able (unset config overrides left out)."""
    given = {k: v for k, v in vars(args).items() if not (k.startswith("cfg_") and v is None)}
    return {k: str(v) if isinstance(v, Path) else v for k, v in given.items()}


def add_llamacpp_args(parser: argparse.ArgumentParser) -> None:
    """llama.cpp's binaries, GGUF files and server settings (bench/llamacpp_system.py)."""
    group = parser.add_argument_group("llama.cpp", "the llama.cpp peer (never a jaxcb dependency)")
    group.add_argument(
        "--llamacpp-server", type=Path, help="llama-server binary: adds the llama.cpp system"
    )
    group.add_argument(
        "--llamacpp-gguf",
        help="comma list of GGUF files, or f32 / bf16 / q4_1 for smollm2-135m's (default: the "
        "--dtype's precision); the first is the llama.cpp row, others extra rows",
    )
    group.add_argument(
        "--llamacpp-dir",
        type=Path,
        help="llama.cpp source dir (default: from --llamacpp-server's build/bin): its "
        "convert_hf_to_gguf.py writes a missing F32/BF16 file",
    )
    group.add_argument(
        "--convert-python", help="python running the converter (needs sentencepiece)"
    )
    group.add_argument(
        "--llamacpp-np", type=int, default=64, help="llama-server -np, parallel slots (%(default)s)"
    )
    group.add_argument("--llamacpp-threads", type=int, default=2, help="-t (%(default)s)")
    group.add_argument(
        "--llamacpp-args",
        default="",
        help="more llama-server flags, one string, e.g. '-b 2048 -ub 512' (default: none)",
    )


def llamacpp_context(args: argparse.Namespace) -> dict[str, Any]:
    """BenchContext fields from add_llamacpp_args' flags."""
    source = args.llamacpp_dir
    if source is None and args.llamacpp_server is not None:
        guess = Path(args.llamacpp_server).resolve().parents[2]  # <llama.cpp>/build/bin/
        source = guess if (guess / "convert_hf_to_gguf.py").is_file() else None
    return dict(
        llamacpp_server=args.llamacpp_server,
        llamacpp_dir=source,
        convert_python=args.convert_python,
        llamacpp_parallel=args.llamacpp_np,
        llamacpp_threads=args.llamacpp_threads,
        llamacpp_extra_args=args.llamacpp_args.split(),
    )


def llamacpp_ggufs(args: argparse.Namespace) -> list[str | None]:
    """--llamacpp-gguf's comma list (None: the --dtype's file), one llama.cpp row each."""
    return [g for g in (args.llamacpp_gguf or "").split(",") if g] or [None]
