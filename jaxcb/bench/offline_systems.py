"""The rows of an offline run (`python -m jaxcb.bench offline`): the chosen systems built from
one BenchContext, with the rows they bring beside them (llama.cpp once per GGUF file; jaxcb's
`--variant` rows and, with `--prefix-caching both`, jaxcb without its prefix cache), and their
timed passes, the rows taking turns.

Progress goes to the context's log (stderr); the report is offline_report.py's.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from jaxcb.bench.offline_report import NO_PREFIX_CACHE
from jaxcb.bench.systems import SYSTEMS, BenchContext
from jaxcb.config import EngineConfig


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """`NAME:FIELD=V,FIELD=V` -> (NAME, {FIELD: V}); ValueError naming what is wrong."""
    name, sep, body = text.partition(":")
    pairs = [p.partition("=") for p in body.split(",") if p]
    if not sep or not name or not pairs or any(not k or not eq for k, eq, _ in pairs):
        raise ValueError(f"--variant must look like NAME:FIELD=V[,FIELD=V], got {text!r}")
    return name, {k.strip(): v.strip() for k, _, v in pairs}


def variant_systems(
    variants: Iterable[str], ctx: BenchContext, config: Path | None
) -> dict[str, Any]:
    """--variant rows: jaxcb with some config fields changed, to run beside jaxcb."""
    systems = {}
    for text in variants:
        name, changes = parse_variant(text)
        overrides = {**ctx.jaxcb_overrides, **changes}
        EngineConfig.from_yaml(config, **overrides)  # a bad field or value fails here
        ctx.log(f"building jaxcb-{name} ({changes}) ...")
        system = SYSTEMS["jaxcb"](replace(ctx, jaxcb_overrides=overrides))
        system.name = f"jaxcb-{name}"
        systems[system.name] = system
    return systems


def without_prefix_cache(ctx: BenchContext) -> dict[str, Any]:
    """--prefix-caching both: jaxcb without its prefix cache, to run beside jaxcb."""
    overrides = {**ctx.jaxcb_overrides, "enable_prefix_caching": False}
    ctx.log(f"building {NO_PREFIX_CACHE} ...")
    return {NO_PREFIX_CACHE: SYSTEMS["jaxcb"](replace(ctx, jaxcb_overrides=overrides))}


def build_systems(
    names: Iterable[str],
    ctx: BenchContext,
    systems: dict[str, Any],
    *,
    ggufs: list[str | None],
    variants: Iterable[str] = (),
    prefix_cache_both: bool = False,
    config: Path | None = None,
) -> None:
    """Build every system of `names` into `systems` (in turn order), so the caller can close
    whatever was built if one fails: llama.cpp once per GGUF file of `ggufs` (the first is
    the row, then llama.cpp-<file>), jaxcb followed by its `variants` and, with
    `prefix_cache_both`, by jaxcb without its prefix cache."""
    for name in names:
        rows = [(name, ctx)]
        if name == "llama.cpp":
            rows = [
                (name if i == 0 else f"{name}-{Path(g).name}", replace(ctx, llamacpp_gguf_choice=g))
                for i, g in enumerate(ggufs)
            ]
        for row, row_ctx in rows:
            ctx.log(f"building {row} ...")
            start = time.perf_counter()
            systems[row] = SYSTEMS[name](row_ctx)
            systems[row].name = row
            ctx.log(f"built {row} in {time.perf_counter() - start:.1f}s")
            if name == "jaxcb":
                if prefix_cache_both:
                    systems |= without_prefix_cache(ctx)
                systems |= variant_systems(variants, ctx, config)


def take_turns(
    systems: dict[str, Any], repeats: dict[str, int], log: Callable[[str], None]
) -> tuple[dict[str, list[dict]], dict[str, Any]]:
    """Round-robin passes, `repeats[name]` of each; returns every pass's record and each
    system's last PassResult."""
    passes: dict[str, list[dict]] = {n: [] for n in systems}
    last = {}
    for round_ in range(max(repeats.values())):
        for name, system in systems.items():
            if round_ >= repeats[name]:
                continue
            log(f"pass {round_ + 1}/{repeats[name]} of {name} ...")
            load = os.getloadavg()[0]  # a busy machine explains a slow pass
            result = last[name] = system.run_pass()
            out = sum(map(len, result.token_ids))
            passes[name].append(dict(wall_s=result.wall_s, output_tokens=out, load_avg=load))
            passes[name][-1].update(result.extra)
            tok_s = out / result.wall_s
            log(f"{name}: {result.wall_s:.1f}s, {tok_s:,.0f} output tok/s")
    return passes, last
