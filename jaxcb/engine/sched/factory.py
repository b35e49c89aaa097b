"""The scheduler wing's one factory: what LLMEngine builds for itself from the config, on
the host side: the scheduler (continuous, or a padded-batch baseline; with its policy and
admission), the swapper for preemption by swap, and the ITL controller."""

from __future__ import annotations

from typing import Any

from jaxcb.config import BATCHING_MODES, EngineConfig
from jaxcb.engine.interface import EngineInfo
from jaxcb.engine.sched.base import BaseScheduler
from jaxcb.engine.sched.baselines import DynamicBatchScheduler, StaticBatchScheduler
from jaxcb.engine.sched.itl_controller import ITLController
from jaxcb.engine.sched.page_pool import PagePool
from jaxcb.engine.sched.policies import check_policy_name, make_policy
from jaxcb.engine.sched.scheduler import Scheduler
from jaxcb.engine.sched.swap import SwapCostModel, Swapper, SwapSpace


def check_scheduler_config(config: EngineConfig) -> None:
    """What only the scheduler wing knows how to check, before anything is built (the
    policy names are the classes in policies.py): a one-line ValueError."""
    check_policy_name(config.scheduler.scheduling_policy)


def build_scheduler(
    config: EngineConfig, pool: PagePool, swapper: Swapper | None = None
) -> BaseScheduler:
    """The scheduler the config asks for (continuous, or a padded-batch baseline)."""
    cache, sched = config.cache, config.scheduler
    watermark_pages = sched.watermark_pages(pool.num_pages)
    if watermark_pages >= pool.num_pages:
        raise ValueError(
            f"watermark={sched.watermark} keeps {watermark_pages} pages free, but the pool "
            f"has only {pool.num_pages}"
        )
    return make_scheduler(
        sched.batching,
        page_pool=pool,
        page_size=cache.page_size,
        max_num_seqs=sched.max_num_seqs,
        max_num_batched_tokens=sched.max_num_batched_tokens,
        policy=make_policy(
            sched.scheduling_policy,
            srpf_aging=sched.srpf_aging,
            edf_late_penalty_ms=sched.edf_late_penalty_ms,
        ),
        enable_prefix_caching=cache.enable_prefix_caching,
        long_prefill_token_threshold=sched.long_prefill_token_threshold,
        watermark_pages=watermark_pages,
        admission=sched.admission,
        admission_quantile=sched.admission_quantile,
        swapper=swapper,
        max_num_sample_rows=config.max_num_sample_rows,
    )


def make_scheduler(
    batching: str,
    *,
    enable_prefix_caching: bool = False,
    long_prefill_token_threshold: int = 0,
    watermark_pages: int = 0,
    admission: str = "greedy",
    admission_quantile: float = 0.9,
    swapper: Swapper | None = None,
    max_num_sample_rows: int | None = None,
    **base: Any,  # BaseScheduler's: page_pool, page_size, max_num_seqs, ...
) -> BaseScheduler:
    """The scheduler for `batching`: the real (continuous) one, or a padded-batch baseline
    (to which prefix caching, the prefill threshold, the watermark and the admission mode
    do not apply: they reserve whole sequences)."""
    if batching == "continuous":
        return Scheduler(
            enable_prefix_caching=enable_prefix_caching,
            long_prefill_token_threshold=long_prefill_token_threshold,
            watermark_pages=watermark_pages,
            admission=admission,
            admission_quantile=admission_quantile,
            swapper=swapper,
            max_num_sample_rows=max_num_sample_rows,
            **base,
        )
    classes = {"static": StaticBatchScheduler, "dynamic": DynamicBatchScheduler}
    if batching not in classes:
        raise ValueError(f"batching must be one of {list(BATCHING_MODES)}, got {batching!r}")
    return classes[batching](**base)


def build_swapper(config: EngineConfig, info: EngineInfo) -> Swapper | None:
    """Preemption by swap as the config asks (`preemption_mode`), over the host slots the
    composition root sized (`info.num_swap_pages`, from swap_space_gb); None: recompute
    only (also with swap_space_gb = 0, or a padded-batch baseline: those never preempt)."""
    sched = config.scheduler
    if (
        sched.preemption_mode == "recompute"
        or config.cache.swap_space_gb == 0
        or sched.batching != "continuous"
    ):
        return None
    cost = None
    if info.swap_bytes_per_s > 0:
        cost = SwapCostModel(
            page_bytes=info.kv_cache_bytes // info.num_pages,
            bytes_per_s=info.swap_bytes_per_s,
            max_num_batched_tokens=sched.max_num_batched_tokens,
        )
    return Swapper(sched.preemption_mode, SwapSpace(info.num_swap_pages), cost)


def build_itl_controller(config: EngineConfig, info: EngineInfo) -> ITLController | None:
    """The ITL controller the config asks for (`itl_target_ms`), over the compiled token
    buckets; None without a target."""
    sched = config.scheduler
    if sched.itl_target_ms is None:
        return None
    return ITLController(
        info.token_buckets,
        target_ms=sched.itl_target_ms,
        percentile=sched.itl_percentile,
        window=sched.itl_window,
        min_prefill_tokens=sched.itl_min_prefill_tokens,
    )
