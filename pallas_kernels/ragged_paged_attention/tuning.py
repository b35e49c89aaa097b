"""Default block sizes of the ragged paged attention kernels, keyed by (head_dim, page_size).

A *query block* is `num_queries_per_block` consecutive query tokens (of one or several
sequences) times the `G = num_q_heads // num_kv_heads` query heads that share a KV head, so
the kernels multiply `[num_queries_per_block * G, head_dim]` query tiles. A *KV block* is
`num_kv_pages_per_block` pages, `num_kv_pages_per_block * page_size` tokens.

Why these numbers (starting points, to be re-tuned on hardware with scripts/bench_kernels.py):
- TPU: the KV block is the lane dim of the score tile, so aim at 128..256 tokens (a multiple
  of 128 lanes); the query block is a multiple of 8 sublanes. Small query blocks keep the
  wasted MXU rows of decode-heavy batches (one useful token per sequence) low.
- GPU (Triton): every block dim is a power of two >= 16 for `tl.dot`. 64-token KV blocks and
  a 64-row query tile keep registers in check at head_dim 128 with 4 warps; head_dim 64
  halves the accumulator so a bigger KV block fits.

Unknown keys fall back to a rule that targets the same KV block width.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiling of one kernel launch; all fields are static (part of the compiled program)."""

    num_queries_per_block: int  # query tokens per block (times G query heads = tile rows)
    num_kv_pages_per_block: int  # pages per KV block
    num_warps: int = 4  # GPU only
    num_stages: int = 2  # GPU only


#: (head_dim, page_size) -> block sizes, per backend.
DEFAULT_BLOCK_SIZES: dict[str, dict[tuple[int, int], BlockSizes]] = {
    "tpu": {
        (64, 16): BlockSizes(num_queries_per_block=16, num_kv_pages_per_block=16),
        (64, 32): BlockSizes(num_queries_per_block=16, num_kv_pages_per_block=8),
        (64, 64): BlockSizes(num_queries_per_block=16, num_kv_pages_per_block=4),
        (128, 16): BlockSizes(num_queries_per_block=16, num_kv_pages_per_block=8),
        (128, 32): BlockSizes(num_queries_per_block=16, num_kv_pages_per_block=4),
        (128, 64): BlockSizes(num_queries_per_block=16, num_kv_pages_per_block=2),
        (128, 128): BlockSizes(num_queries_per_block=16, num_kv_pages_per_block=1),
        (256, 16): BlockSizes(num_queries_per_block=8, num_kv_pages_per_block=8),
    },
    "gpu": {
        (64, 16): BlockSizes(16, 8, num_warps=4, num_stages=2),
        (64, 32): BlockSizes(16, 4, num_warps=4, num_stages=2),
        (64, 64): BlockSizes(16, 2, num_warps=4, num_stages=2),
        (128, 16): BlockSizes(16, 4, num_warps=4, num_stages=2),
        (128, 32): BlockSizes(16, 2, num_warps=4, num_stages=2),
        (128, 64): BlockSizes(16, 1, num_warps=4, num_stages=2),
        (256, 16): BlockSizes(16, 2, num_warps=8, num_stages=1),
    },
}

#: KV block width (tokens) targeted for keys missing from the table.
_FALLBACK_KV_TOKENS = {"tpu": 128, "gpu": 64}


def default_block_sizes(backend: str, head_dim: int, page_size: int) -> BlockSizes:
    """Block sizes for `backend` ("tpu" | "gpu"): the table entry, else a rule of thumb."""
    if backend not in DEFAULT_BLOCK_SIZES:
        raise ValueError(f"{backend=} must be one of {sorted(DEFAULT_BLOCK_SIZES)}")
    table = DEFAULT_BLOCK_SIZES[backend]
    if (head_dim, page_size) in table:
        return table[(head_dim, page_size)]
    pages = max(1, _FALLBACK_KV_TOKENS[backend] // page_size)
    if backend == "gpu":
        # Triton tiles are powers of two: round the page count down to one.
        pages = 1 << (pages.bit_length() - 1)
    return BlockSizes(num_queries_per_block=16, num_kv_pages_per_block=pages)
