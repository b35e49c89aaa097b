"""Block sizes of the ragged paged attention kernels: a TPU table keyed by (head_dim,
page_size), and a GPU table keyed by padded head_dim and batch kind, checked for shared memory.

A *query block* is `num_queries_per_block` consecutive query tokens (of one or several
sequences) times the `G = num_q_heads // num_kv_heads` query heads that share a KV head, so
the kernels multiply `[num_queries_per_block * G, head_dim]` query tiles. A *KV block* is
`num_kv_pages_per_block` pages, `num_kv_pages_per_block * page_size` tokens.

Why these numbers (starting points, to be re-tuned on hardware with
`python -m jaxcb.bench kernels`):
- TPU: the KV block is the lane dim of the score tile, so aim at 128..256 tokens (a multiple
  of 128 lanes); the query block is a multiple of 8 sublanes. Small query blocks keep the
  wasted MXU rows of decode-heavy batches (one useful token per sequence) low.
- GPU (Triton): see `GPU_TILES` and `gpu_block_sizes` below.

Unknown TPU keys fall back to a rule that targets the same KV block width.
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
    num_kv_splits: int = 1  # GPU only: split-KV factor (grid axis over KV shares)


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
}

#: KV block width (tokens) targeted for keys missing from the table.
_FALLBACK_KV_TOKENS = {"tpu": 128}


def default_block_sizes(backend: str, head_dim: int, page_size: int) -> BlockSizes:
    """TPU block sizes: the table entry, else a rule of thumb. The GPU kernel's depend on more
    than (head_dim, page_size): `gpu_block_sizes`."""
    if backend == "gpu":
        raise ValueError("backend='gpu' block sizes depend on the batch shape: use gpu_block_sizes")
    if backend not in DEFAULT_BLOCK_SIZES:
        raise ValueError(f"{backend=} must be one of {sorted(DEFAULT_BLOCK_SIZES)}")
    table = DEFAULT_BLOCK_SIZES[backend]
    if (head_dim, page_size) in table:
        return table[(head_dim, page_size)]
    pages = max(1, _FALLBACK_KV_TOKENS[backend] // page_size)
    return BlockSizes(num_queries_per_block=16, num_kv_pages_per_block=pages)


# --- GPU (Triton) ---------------------------------------------------------------------------
#
# A Triton tile is [query_rows, Dp] x [kv_tokens, Dp] with Dp = head_dim padded to a power of
# two; every dim a power of two >= 16 (`tl.dot`). The table gives, per Dp, one tile for
# decode-shaped buckets (num_tokens <= max_num_seqs: about one token per sequence, so a query
# block spans many sequences and only G of its rows share a KV page; small tiles waste fewer
# MMA rows and give more programs) and one for prefill-shaped buckets (many tokens of one
# sequence share each KV block: bigger tiles reuse each K/V load more). Shared memory is what
# limits the tile: `gpu_shared_memory_bytes` estimates it and `gpu_block_sizes` narrows the
# KV block until it fits; tests check every table entry against the H100 limit and the AOT
# compile checks the real figure (tests/kernels/test_rpa_gpu_compile.py).
#
# num_stages: compiling for H100 with 1..4 stages gave the same shared memory for this
# kernel: its K/V loads are gathers in a loop nested under the sequence loop, which Triton's
# software pipeliner leaves alone. Latency is hidden by resident programs instead, hence the
# split-KV target below. The table keeps 2 (no effect today; were the loads ever pipelined,
# the estimate would undercount and the compile test would catch it).

#: H100 SXM: opt-in shared memory per thread block (227 KiB; XLA's h100_sxm GPU spec) and SMs.
H100_SHARED_MEMORY_PER_BLOCK = 232448
H100_NUM_SMS = 132

#: Split-KV is used when the grid (query blocks x KV heads) has fewer programs than this many
#: per SM. Decode is bandwidth-bound and the K/V loads are not pipelined (above), so several
#: resident programs per SM must keep loads in flight; a decode tile takes ~22 KB of shared
#: memory, so 4 fit easily. A starting point, unmeasured on hardware.
PROGRAMS_PER_SM = 4
#: At most this many splits, and each split keeps >= this many KV blocks of the longest
#: possible context, so the combine (f32 partials) stays small next to the K/V reads.
MAX_KV_SPLITS = 16
MIN_KV_BLOCKS_PER_SPLIT = 4


@dataclasses.dataclass(frozen=True)
class GpuTile:
    """One Triton tiling before it meets a batch shape (G, page_size, dtype)."""

    query_rows: int  # tile rows: query tokens x padded G
    kv_tokens: int  # KV block width in tokens
    num_warps: int
    num_stages: int


#: padded head_dim -> {"decode" | "prefill": tile}. Head dims below 64 use the 64 entry.
#: Shared memory at bf16, decode / prefill (the estimate, equal to the H100 compile's):
#: 64: 22528 / 40960; 128: 22528 / 49152; 256: 25600 / 65536 bytes.
GPU_TILES: dict[int, dict[str, GpuTile]] = {
    64: {"decode": GpuTile(16, 128, 4, 2), "prefill": GpuTile(64, 128, 4, 2)},
    128: {"decode": GpuTile(16, 64, 4, 2), "prefill": GpuTile(64, 64, 4, 2)},
    256: {"decode": GpuTile(16, 32, 4, 2), "prefill": GpuTile(64, 32, 8, 2)},
}


def padded_head_dim(head_dim: int) -> int:
    """The Triton kernel's head_dim: the next power of two, at least 16."""
    if head_dim <= 0:
        raise ValueError(f"{head_dim=} must be positive")
    return max(16, 1 << (head_dim - 1).bit_length())


def gpu_shared_memory_bytes(
    *,
    head_dim: int,
    query_rows: int,
    kv_tokens: int,
    itemsize: int,
    num_stages: int = 1,
    kv_scales: bool = False,
) -> int:
    """Shared memory of one Triton program of the kernel on H100 (sm_90), in bytes.

    A model of what XLA's Triton allocates for this kernel (exact on every tile measured:
    head_dim 64/96/128/256, rows 16..128, KV 32..256 tokens, bf16 and f32, 4 and 8 warps),
    with tiles q = query_rows x Dp, kv = kv_tokens x Dp and p = query_rows x kv_tokens:
    - rows >= 64: the dots are Hopper wgmma with q, K and V staged in shared memory (p stays
      in registers): q + 2 kv.
    - rows < 64: mma.sync through one K/V buffer (K and V take turns) plus q and p:
      q + kv + p.
    - f32 (full-precision dots, `reference.FULL`: no tensor-core path): q + 2 kv + p, and up
      to a row vector of reduction scratch (rows x 4 bytes), counted: an upper bound by at
      most that vector (measured on H100 at head_dim 64 and 128, rows 16-128, KV 32-128).
    `num_stages` changes nothing (measured; see the comment above the table).
    Quantized pages (`kv_scales`; `itemsize` is then q's, the dtype the tiles are converted
    to) add the two f32 scale vectors of a KV block: an upper bound (measured on H100, int8
    and fp8 at head_dim 64/128: equal for prefill tiles, 10-11 KB less for decode tiles).
    """
    del num_stages
    scales = 2 * kv_tokens * 4 if kv_scales else 0
    dim = padded_head_dim(head_dim)
    q = query_rows * dim * itemsize
    kv = kv_tokens * dim * itemsize
    p = query_rows * kv_tokens * itemsize
    if itemsize >= 4:
        return q + 2 * kv + p + query_rows * 4 + scales
    if query_rows >= 64:
        return q + 2 * kv + scales
    return q + kv + p + scales


def gpu_block_sizes(
    *,
    head_dim: int,
    page_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    num_tokens: int,
    max_num_seqs: int,
    pages_per_seq: int,
    itemsize: int,
    num_sms: int = H100_NUM_SMS,
    shared_memory_limit: int = H100_SHARED_MEMORY_PER_BLOCK,
    kv_scales: bool = False,
) -> BlockSizes:
    """Block sizes, launch parameters and split-KV factor of the GPU kernel for static shapes.

    Steps: the table's tile for (padded head_dim, decode|prefill); query tokens per block =
    query_rows / padded G (>= 1); pages per block = kv_tokens / page_size (>= 1); then a
    narrower KV block, then fewer query rows, while the shared-memory estimate exceeds the
    limit (a ValueError if one page and 16 rows still do not fit: f32 at head_dim 256 and
    page_size 128).
    The split-KV factor: `gpu_num_kv_splits`. Quantized pages: `itemsize` of q (the tiles'
    dtype after conversion) and `kv_scales=True`.
    """
    dim = padded_head_dim(head_dim)
    if dim > max(GPU_TILES):
        raise ValueError(f"{head_dim=} exceeds the largest GPU tile head_dim {max(GPU_TILES)}")
    kind = "decode" if num_tokens <= max_num_seqs else "prefill"
    tile = GPU_TILES[max(dim, min(GPU_TILES))][kind]
    padded_group = 1 << (num_q_heads // num_kv_heads - 1).bit_length()
    block_q = max(1, tile.query_rows // padded_group)
    pages = max(1, tile.kv_tokens // page_size)

    def smem() -> int:
        return gpu_shared_memory_bytes(
            head_dim=head_dim,
            query_rows=max(16, block_q * padded_group),
            kv_tokens=pages * page_size,
            itemsize=itemsize,
            num_stages=tile.num_stages,
            kv_scales=kv_scales,
        )

    while smem() > shared_memory_limit and pages > 1:
        pages //= 2
    while smem() > shared_memory_limit and block_q * padded_group > 16 and block_q > 1:
        block_q //= 2
    if smem() > shared_memory_limit:
        raise ValueError(
            f"no GPU tile fits {shared_memory_limit} bytes of shared memory for "
            f"{head_dim=}, {page_size=}, {itemsize=}: use a smaller page_size"
        )

    splits = gpu_num_kv_splits(
        num_q_blocks=-(-num_tokens // block_q),
        num_kv_heads=num_kv_heads,
        max_kv_blocks=-(-pages_per_seq // pages),
        num_sms=num_sms,
    )
    return BlockSizes(
        num_queries_per_block=block_q,
        num_kv_pages_per_block=pages,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        num_kv_splits=splits,
    )


def gpu_num_kv_splits(
    *, num_q_blocks: int, num_kv_heads: int, max_kv_blocks: int, num_sms: int = H100_NUM_SMS
) -> int:
    """Split-KV factor: 1 unless the grid is too small to keep the GPU's SMs busy.

    With `programs = num_q_blocks x num_kv_heads < target = PROGRAMS_PER_SM x num_sms`, split
    every sequence's KV into `ceil(target / programs)` shares, capped by MAX_KV_SPLITS and by
    `max_kv_blocks` (KV blocks of the longest possible context) / MIN_KV_BLOCKS_PER_SPLIT.
    Static shapes cannot tell long contexts from short: with short ones most splits find no
    KV block and exit at once, and the combine reads back only small f32 partials.
    """
    programs = num_q_blocks * num_kv_heads
    target = PROGRAMS_PER_SM * num_sms
    if programs >= target:
        return 1
    cap = min(MAX_KV_SPLITS, max_kv_blocks // MIN_KV_BLOCKS_PER_SPLIT)
    return max(1, min(-(-target // programs), cap))
