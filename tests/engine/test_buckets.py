"""Token-budget buckets: default sets, sequence caps and smallest-fit choice."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxcb.engine.buckets import Bucket, default_token_buckets, make_buckets, pick_bucket


@pytest.mark.parametrize(
    ("max_tokens", "smallest", "want"),
    [
        (512, 16, (16, 32, 64, 128, 256, 512)),
        (64, 16, (16, 32, 64)),
        (100, 16, (16, 32, 64, 100)),
        (16, 16, (16,)),
        (8, 16, (8,)),
        (1, 16, (1,)),
        (20, 4, (4, 8, 16, 20)),
        (17, 16, (16, 17)),
    ],
)
def test_default_token_buckets(max_tokens: int, smallest: int, want: tuple[int, ...]) -> None:
    assert default_token_buckets(max_tokens, smallest) == want


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 1 << 16), st.integers(1, 64))
def test_default_token_buckets_properties(max_tokens: int, smallest: int) -> None:
    buckets = default_token_buckets(max_tokens, smallest)
    assert buckets[-1] == max_tokens
    assert buckets[0] == min(smallest, max_tokens)
    assert list(buckets) == sorted(set(buckets))
    for a, b in itertools.pairwise(buckets[:-1]):
        assert b == 2 * a  # powers of two up to the last, which is the budget itself
    assert len(buckets) == 1 or buckets[-1] <= 2 * buckets[-2]


@pytest.mark.parametrize(("max_tokens", "smallest"), [(0, 16), (-4, 16), (64, 0), (64, -1)])
def test_default_token_buckets_rejects_bad_sizes(max_tokens: int, smallest: int) -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        default_token_buckets(max_tokens, smallest)


def test_make_buckets_caps_sequences() -> None:
    assert make_buckets((4, 16, 64), 8) == (Bucket(4, 4), Bucket(16, 8), Bucket(64, 8))


@pytest.mark.parametrize(
    ("token_buckets", "max_num_seqs", "match"),
    [
        ((), 4, "non-empty"),
        ((0, 16), 4, ">= 1"),
        ((64, 16, 32), 4, "strictly increasing"),
        ((16, 16, 32), 4, "strictly increasing"),
        ((16, 32), 0, "max_num_seqs"),
    ],
)
def test_make_buckets_rejects_bad_sets(
    token_buckets: tuple[int, ...], max_num_seqs: int, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        make_buckets(token_buckets, max_num_seqs)


def test_pick_bucket_examples() -> None:
    buckets = make_buckets((16, 32, 64), 24)
    assert pick_bucket(buckets, 1, 1) == Bucket(16, 16)
    assert pick_bucket(buckets, 16, 16) == Bucket(16, 16)
    assert pick_bucket(buckets, 17, 1) == Bucket(32, 24)
    assert pick_bucket(buckets, 10, 17) == Bucket(32, 24)  # enough tokens, too few rows
    assert pick_bucket(buckets, 64, 24) == Bucket(64, 24)
    with pytest.raises(ValueError, match="65 tokens"):
        pick_bucket(buckets, 65, 1)
    with pytest.raises(ValueError, match="25 sequences"):
        pick_bucket(buckets, 30, 25)


@st.composite
def bucket_sets(draw: st.DrawFn) -> tuple[Bucket, ...]:
    sizes = draw(st.lists(st.integers(1, 300), min_size=1, max_size=8, unique=True))
    return make_buckets(tuple(sorted(sizes)), draw(st.integers(1, 64)))


@settings(max_examples=200, deadline=None)
@given(bucket_sets(), st.integers(0, 320), st.integers(0, 70))
def test_pick_bucket_is_the_smallest_fit(
    buckets: tuple[Bucket, ...], num_tokens: int, num_seqs: int
) -> None:
    fits = [b for b in buckets if b.num_tokens >= num_tokens and b.num_seqs >= num_seqs]
    if not fits:
        with pytest.raises(ValueError, match="fits no bucket"):
            pick_bucket(buckets, num_tokens, num_seqs)
        return
    assert pick_bucket(buckets, num_tokens, num_seqs) == min(fits, key=lambda b: b.num_tokens)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 2048), st.integers(1, 256), st.data())
def test_every_schedulable_batch_fits_the_default_set(
    budget: int, max_num_seqs: int, data: st.DataObject
) -> None:
    """What the scheduler can emit (T <= budget tokens, S <= min(T, max_num_seqs) sequences)
    always has a bucket, and no smaller bucket would do."""
    buckets = make_buckets(default_token_buckets(budget), max_num_seqs)
    t = data.draw(st.integers(1, budget))
    s = data.draw(st.integers(1, min(t, max_num_seqs)))
    b = pick_bucket(buckets, t, s)
    assert b.num_tokens >= t and b.num_seqs >= s
    assert all(smaller.num_tokens < t for smaller in buckets if smaller.num_tokens < b.num_tokens)


def test_sequence_buckets_give_few_sequence_steps_small_rows() -> None:
    buckets = make_buckets((16, 64, 256), 128, seq_buckets=(16,))
    assert buckets == (
        Bucket(16, 16),
        Bucket(64, 16),
        Bucket(64, 64),
        Bucket(256, 16),
        Bucket(256, 128),
    )
    assert pick_bucket(buckets, 150, 1) == Bucket(256, 16)  # a lone prompt: 16 rows
    assert pick_bucket(buckets, 150, 17) == Bucket(256, 128)
    assert pick_bucket(buckets, 40, 40) == Bucket(64, 64)
    assert pick_bucket(buckets, 64, 65) == Bucket(256, 128)  # more sequences: a bigger T
    with pytest.raises(ValueError, match="sequence buckets must be >= 1"):
        make_buckets((16,), 8, seq_buckets=(0,))
