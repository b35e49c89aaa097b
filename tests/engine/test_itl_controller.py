"""The ITL controller (engine/sched/itl_controller.py) on synthetic latency series, and the
scheduler's per-step token budget it drives: the budget falls when the tail exceeds the
target, rises while there is headroom, holds in between, never leaves the bucket set and
never goes under the floor."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxcb.config import SchedulerConfig
from jaxcb.engine.request import Request
from jaxcb.engine.sched.itl_controller import ITLController, shared_token_budget
from jaxcb.engine.sched.page_pool import PagePool
from jaxcb.engine.sched.scheduler import Scheduler
from jaxcb.sampling_params import SamplingParams

BUCKETS = (16, 32, 64, 128, 256)
TARGET_MS = 30.0


def controller(**kwargs) -> ITLController:
    return ITLController(BUCKETS, target_ms=TARGET_MS, **kwargs)


def step_ms(tokens: int) -> float:
    """A step's time as a linear function of its bucket: 2 ms + 0.2 ms a token."""
    return 2.0 + 0.2 * tokens


def simulate(ctl: ITLController, num_steps: int, *, num_decodes: int = 8, seed: int = 0):
    """A busy server: `num_decodes` decodes and always more prefill than the budget takes, a
    step's time from step_ms with 3% noise. Returns each step's (budget, ITL seconds)."""
    rng = np.random.default_rng(seed)
    trace = []
    for _ in range(num_steps):
        budget = ctl.step_budget(num_decodes)
        seconds = step_ms(budget) * (1 + 0.03 * rng.standard_normal()) / 1000
        trace.append((budget, seconds))
        ctl.feed(seconds, True, budget)
    return trace


def test_settles_on_the_largest_budget_within_the_target():
    ctl = controller()
    trace = simulate(ctl, 2000)
    assert trace[0][0] == 256  # the fixed budget until something is measured
    # 256 (53 ms) breaks the 30 ms target; 128 (27.6 ms) holds it; 64 (14.8 ms) wastes it.
    settled = [b for b, _ in trace[-1000:]]
    assert set(settled) == {128}
    itl = np.array([s for _, s in trace[-1000:]])
    assert np.quantile(itl, 0.9) * 1000 <= TARGET_MS
    # the cut from 256 jumps straight to the bucket the measured time predicts fits (64),
    # then the headroom there raises it one bucket
    changes = [b for (a, _), (b, _) in itertools.pairwise(trace) if a != b]
    assert changes[:2] == [64, 128]
    assert ctl.budget == 128 and ctl.num_cuts == 1 and ctl.num_raises == 1


def test_tail_over_the_target_cuts_within_the_allowed_samples():
    ctl = controller(window=64, percentile=0.9)
    # a full window of p90 may hold 6 samples above the target: the 7th makes it certain
    for i in range(6):
        ctl.feed(0.040, True, 256)
        assert ctl.budget == 256, i
    ctl.feed(0.040, True, 256)
    assert ctl.budget < 256 and ctl.num_cuts == 1


def test_p99_cuts_at_the_first_sample_over_a_small_window():
    ctl = controller(window=64, percentile=0.99)
    ctl.feed(0.031, True, 256)
    assert ctl.num_cuts == 1


def test_budget_rises_with_headroom_and_falls_when_the_tail_exceeds():
    """A synthetic series: slow steps cut the budget, fast ones raise it one bucket per
    window, slow ones cut it again, down to the smallest bucket."""
    ctl = controller(window=32)
    while ctl.num_cuts == 0:
        ctl.feed(0.100, True, ctl.budget)
    low = ctl.budget
    assert low == 32  # 100 ms at 256 predicts 25 ms at 64 (over 0.8 x 30), 12.5 at 32
    fast = [ctl.feed(0.005, True, ctl.budget) for _ in range(32 * 6)]
    assert fast[32 - 2] == 32 and fast[32 - 1] == 64  # a full window at 32, then up
    assert fast[-1] == 128  # one bucket per window, up to 128: 256 was measured too slow
    ups = [b for a, b in zip([low, *fast], fast, strict=False) if b != a]
    assert ups == [64, 128]
    slow = [ctl.feed(0.050, True, ctl.budget) for _ in range(40)]
    assert slow[-1] == 16  # nothing fits 50 ms steps
    assert all(b <= a for a, b in itertools.pairwise(slow))


def test_the_hysteresis_band_holds():
    """A tail between headroom x target and the target neither cuts nor raises."""
    ctl = controller(window=16)
    ctl.feed(0.100, True, 256)
    for _ in range(7):
        ctl.feed(0.100, True, 256)
    held = ctl.budget
    assert held < 256
    for _ in range(16 * 20):
        ctl.feed(0.027, True, held)  # 0.9 x target
    assert ctl.budget == held and ctl.num_raises == 0


def test_steps_under_the_budget_do_not_raise_it():
    """Fast decode-only steps in a small bucket say nothing about a bigger budget."""
    ctl = controller(window=16)
    while ctl.num_cuts == 0:
        ctl.feed(0.060, True, 256)
    cut = ctl.budget
    assert cut == 64
    for _ in range(16 * 10):
        ctl.feed(0.001, True, 16)
    assert ctl.budget == cut and ctl.num_raises == 0


def test_steps_without_decodes_are_not_itl_samples():
    ctl = controller(window=16)
    for _ in range(100):
        ctl.feed(1.0, False, 256)  # a long prefill keeps nobody waiting
    assert ctl.budget == 256 and ctl.num_samples == 0 and ctl.tail() is None
    assert ctl.predict(4) == pytest.approx(1.0)  # but the step time is learnt
    assert ctl.predict(0) == pytest.approx(1.0 * 16 / 256)


def test_a_recently_measured_slow_bucket_is_not_tried_until_its_measure_is_old():
    ctl = controller(window=16)
    while ctl.num_cuts == 0:
        ctl.feed(0.040, True, 256)  # 256's average: 40 ms > 30 ms
    assert ctl.budget == 128
    for _ in range(16 * 7):
        ctl.feed(0.010, True, 128)
    assert ctl.budget == 128 and ctl.num_raises == 0
    for _ in range(16 * 2):  # 8 windows on, the measurement is old: 256 gets another try
        ctl.feed(0.010, True, 128)
    assert ctl.budget == 256 and ctl.num_raises == 1


def test_an_edge_budget_is_probed_less_and_less_often():
    """128's mean fits the target but its tail does not: each failed probe doubles the wait
    (to 8 windows) before the next, so the budget does not oscillate every window."""
    ctl = controller(window=16)
    rng = np.random.default_rng(1)
    raises = []
    for step in range(16 * 80):
        budget = ctl.budget
        if budget == 128:  # mean 24 ms, a third of the steps at 36 ms
            seconds = 0.036 if rng.random() < 0.33 else 0.018
        else:
            seconds = step_ms(budget) / 1000
        before = ctl.num_raises
        ctl.feed(seconds, True, budget)
        if ctl.num_raises > before:
            raises.append(step)
    gaps = np.diff(raises)
    assert len(gaps) >= 4
    assert all(gap >= 16 << min(i + 1, 3) for i, gap in enumerate(gaps))


def test_floor_holds():
    ctl = controller(window=8, min_prefill_tokens=16)
    for _ in range(100):
        ctl.feed(1.0, True, ctl.budget)  # nothing fits: the smallest bucket
    assert ctl.budget == 16
    assert ctl.step_budget(1) == 32  # 1 decode + 16 prefill tokens
    assert ctl.step_budget(16) == 32
    assert ctl.step_budget(17) == 64
    assert ctl.step_budget(200) == 256  # no bucket holds 216 + 16: the largest
    assert ctl.step_budget(0) == 256  # no decode waits on the step


@settings(max_examples=50, deadline=None)
@given(
    series=st.lists(
        st.tuples(
            st.floats(0.0001, 0.2),
            st.booleans(),
            st.integers(0, 300),
            st.integers(0, len(BUCKETS) - 1),
        ),
        min_size=1,
        max_size=400,
    ),
    percentile=st.sampled_from([0.5, 0.9, 0.99]),
    window=st.integers(2, 40),
    min_prefill=st.integers(1, 64),
)
def test_only_bucket_sizes_and_never_below_the_floor(series, percentile, window, min_prefill):
    ctl = controller(percentile=percentile, window=window, min_prefill_tokens=min_prefill)
    for seconds, had_decode, num_decodes, k in series:
        num_decodes = num_decodes if had_decode else 0
        budget = ctl.step_budget(num_decodes)
        assert budget in BUCKETS and ctl.budget in BUCKETS
        need = num_decodes + min_prefill
        assert budget >= min(need, BUCKETS[-1])
        assert budget >= ctl.budget
        # the step ran in its budget's bucket or a smaller one
        assert ctl.feed(seconds, had_decode, min(BUCKETS[k], budget)) in BUCKETS


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(target_ms=0.0), "itl_target_ms"),
        (dict(target_ms=30.0, percentile=1.0), "itl_percentile"),
        (dict(target_ms=30.0, window=1), "itl_window"),
        (dict(target_ms=30.0, min_prefill_tokens=0), "itl_min_prefill_tokens"),
        (dict(target_ms=30.0, headroom=1.0), "headroom"),
    ],
)
def test_bad_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ITLController(BUCKETS, **kwargs)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(itl_target_ms=0.0), "itl_target_ms must be > 0"),
        (dict(itl_percentile=1.0), "itl_percentile must be in"),
        (dict(itl_window=1), "itl_window must be >= 2"),
        (dict(itl_min_prefill_tokens=0), "itl_min_prefill_tokens must be >= 1"),
        (dict(itl_target_ms=30.0, batching="static"), "itl_target_ms needs batching"),
        (dict(min_token_budget=1024), "min_token_budget must be in"),
    ],
)
def test_bad_config_names_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**fields)


def test_feed_rejects_a_bucket_outside_the_set():
    with pytest.raises(ValueError, match="bucket_tokens=48"):
        controller().feed(0.01, True, 48)


# ---- the scheduler's per-step budget ----------------------------------------------------------


def make_scheduler(budget: int = 64) -> Scheduler:
    return Scheduler(
        page_pool=PagePool(256), page_size=4, max_num_seqs=8, max_num_batched_tokens=budget
    )


def request(rid: int, prompt_len: int) -> Request:
    return Request(
        request_id=str(rid),
        prompt_token_ids=list(range(3, 3 + prompt_len)),
        params=SamplingParams(max_tokens=8),
        seed=rid,
        max_tokens=8,
        eos_token_ids=frozenset(),
        arrival_time=0.0,
    )


def test_scheduler_takes_a_smaller_token_budget_decodes_first():
    sched = make_scheduler()
    for rid in range(4):
        sched.add(request(rid, 1))  # one-token prompts: decoding from their first step
    sched.update_after_step(sched.schedule())
    for r in sched.running:
        r.append_token(5)
    sched.add(request(9, 200))
    out = sched.schedule(token_budget=16)
    assert [c.num_tokens for c in out.chunks] == [1, 1, 1, 1, 12]  # decodes, then prefill
    sched.update_after_step(out)
    for bad in (0, 65):
        with pytest.raises(ValueError, match="token_budget"):
            sched.schedule(token_budget=bad)


SERVE_BUCKETS = [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024]


def test_a_shared_budget_takes_a_prompt_whole_beside_one_decode_and_chunks_beside_many():
    budget = [shared_token_budget(SERVE_BUCKETS, 1024, 256, d) for d in (0, 1, 2, 3, 4, 64)]
    assert budget == [1024, 1024, 512, 256, 256, 256]
    assert shared_token_budget(SERVE_BUCKETS, 1024, 16, 100) == 128  # every decode's token


@settings(max_examples=200, deadline=None)
@given(
    largest_index=st.integers(0, len(SERVE_BUCKETS) - 1),
    floor=st.integers(0, 1024),
    num_decodes=st.integers(0, 2048),
)
def test_a_shared_budget_stays_in_bounds(largest_index, floor, num_decodes):
    buckets = SERVE_BUCKETS[: largest_index + 1]
    largest = buckets[-1]
    floor = min(floor, largest)
    budget = shared_token_budget(buckets, largest, floor, num_decodes)
    assert budget in buckets and floor <= budget <= largest
    assert budget >= min(num_decodes, largest)  # decodes are never cut while they fit
