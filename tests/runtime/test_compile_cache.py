"""A second engine start loads every bucket from the persistent compilation cache."""

from __future__ import annotations

from helpers import TINY_MODEL

from jaxcb import LLM, SamplingParams

CONFIG = dict(
    model=TINY_MODEL,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    token_buckets=[16, 32],
    max_model_len=128,
)


def test_second_start_uses_the_compilation_cache(tmp_path):
    cache = tmp_path / "xla"
    first = LLM(compilation_cache=str(cache), **CONFIG)
    cold = first.stats()
    assert cold["compile_cache"] == {
        "dir": str(cache),
        "buckets_compiled": 2,
        "buckets_from_cache": 0,
        "buckets_in_background": 0,
    }
    second = LLM(compilation_cache=str(cache), **CONFIG)
    warm = second.stats()
    assert warm["compile_cache"]["buckets_compiled"] == 0
    assert warm["compile_cache"]["buckets_from_cache"] == 2
    sp = SamplingParams(max_tokens=5, temperature=0)
    assert (
        first.generate([[4, 5, 6]], sp, use_tqdm=False)[0].token_ids
        == second.generate([[4, 5, 6]], sp, use_tqdm=False)[0].token_ids
    )


def test_cache_off():
    llm = LLM(compilation_cache="off", **CONFIG)
    assert llm.stats()["compile_cache"] == {
        "dir": None,
        "buckets_compiled": 2,
        "buckets_from_cache": 0,
        "buckets_in_background": 0,
    }
