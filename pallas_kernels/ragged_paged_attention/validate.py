"""Input checks for ragged paged attention, shared by every backend.

`static_validate_inputs` looks only at shapes and dtypes, so it runs at trace time inside jit
and costs nothing per step. `dynamic_validate_inputs` needs concrete values (it pulls the
metadata to the host); use it in tests, debugging and the engine's slow path, never inside a
jitted step. Both raise `ValueError` naming the offending values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ragged_paged_attention.kv_quant import check_scales, is_quantized_kv


def static_validate_inputs(
    q: jax.Array,  # [T, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scales: jax.Array | None = None,  # f32[num_kv_heads, num_pages, page_size]
    v_scales: jax.Array | None = None,  # f32[num_kv_heads, num_pages, page_size]
) -> None:
    """Check ranks, shapes, dtypes and divisibility; works on tracers and ShapeDtypeStructs.

    K/V pages are floating point, or quantized (int8, float8_e4m3fn, float8_e5m2) with
    float32 `k_scales` and `v_scales` of shape `[num_kv_heads, num_pages, page_size]`."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, num_q_heads, head_dim], got {q.shape=}")
    if k_pages.ndim != 4:
        raise ValueError(
            f"k_pages must be [num_kv_heads, num_pages, page_size, head_dim], got {k_pages.shape=}"
        )
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"{k_pages.shape=} must equal {v_pages.shape=}")
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"{k_pages.dtype=} must equal {v_pages.dtype=}")
    _, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, kv_head_dim = k_pages.shape
    if kv_head_dim != head_dim:
        raise ValueError(f"{head_dim=} of q must equal {kv_head_dim=} of k_pages/v_pages")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads=} must be divisible by {num_kv_heads=}")
    if page_size <= 0 or head_dim <= 0:
        raise ValueError(f"{page_size=} and {head_dim=} must be positive")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be floating point, got {q.dtype=}")
    if not (jnp.issubdtype(k_pages.dtype, jnp.floating) or is_quantized_kv(k_pages.dtype)):
        raise ValueError(
            f"k_pages must be floating point or int8/fp8 with scales, got {k_pages.dtype=}"
        )
    check_scales(k_pages, v_pages, k_scales, v_scales)
    for name, x, ndim in (
        ("kv_lens", kv_lens, 1),
        ("page_indices", page_indices, 2),
        ("cu_q_lens", cu_q_lens, 1),
        ("num_seqs", num_seqs, 1),
    ):
        if x.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {x.dtype}")
        if x.ndim != ndim:
            raise ValueError(f"{name} must have rank {ndim}, got shape {x.shape}")
    max_num_seqs = kv_lens.shape[0]
    if max_num_seqs == 0:
        raise ValueError(f"kv_lens must hold at least one sequence slot, got {kv_lens.shape=}")
    if page_indices.shape[0] != max_num_seqs:
        raise ValueError(
            f"page_indices rows ({page_indices.shape[0]}) must equal len(kv_lens) ({max_num_seqs})"
        )
    if page_indices.shape[1] == 0:
        raise ValueError(f"page_indices must have at least one column, got {page_indices.shape=}")
    if cu_q_lens.shape[0] != max_num_seqs + 1:
        raise ValueError(
            f"cu_q_lens must have len(kv_lens) + 1 = {max_num_seqs + 1} entries, "
            f"got {cu_q_lens.shape[0]}"
        )
    if num_seqs.shape != (1,):
        raise ValueError(f"num_seqs must have shape (1,), got {num_seqs.shape}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"{sliding_window=} must be positive or None")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"{soft_cap=} must be positive or None")


def dynamic_validate_inputs(
    q: jax.Array,  # [T, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scales: jax.Array | None = None,  # f32[num_kv_heads, num_pages, page_size]
    v_scales: jax.Array | None = None,  # f32[num_kv_heads, num_pages, page_size]
) -> None:
    """Static checks, then checks of the concrete metadata values (host-side, not jittable)."""
    static_validate_inputs(
        q,
        k_pages,
        v_pages,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scales=k_scales,
        v_scales=v_scales,
    )
    num_tokens = q.shape[0]
    _, num_pages, page_size, _ = k_pages.shape
    pages_per_seq = page_indices.shape[1]
    kv_lens_np = np.asarray(kv_lens)  # i32[S]
    page_indices_np = np.asarray(page_indices)  # i32[S, pages_per_seq]
    cu_np = np.asarray(cu_q_lens)  # i32[S + 1]
    n = int(np.asarray(num_seqs)[0])

    if not 0 <= n <= kv_lens_np.shape[0]:
        raise ValueError(f"num_seqs={n} must be in [0, {kv_lens_np.shape[0]}]")
    if cu_np[0] != 0:
        raise ValueError(f"cu_q_lens[0]={cu_np[0]} must be 0")
    live_cu = cu_np[: n + 1]
    steps = np.diff(live_cu)
    if np.any(steps < 0):
        s = int(np.argmax(steps < 0))
        raise ValueError(
            f"cu_q_lens must be non-decreasing: cu_q_lens[{s}]={live_cu[s]} > "
            f"cu_q_lens[{s + 1}]={live_cu[s + 1]}"
        )
    if live_cu[-1] > num_tokens:
        raise ValueError(f"cu_q_lens[num_seqs]={live_cu[-1]} exceeds the {num_tokens} query rows")
    max_kv_len = pages_per_seq * page_size
    for s in range(n):
        q_len, kv_len = int(steps[s]), int(kv_lens_np[s])
        if kv_len < 0 or kv_len > max_kv_len:
            raise ValueError(
                f"kv_lens[{s}]={kv_len} must be in [0, pages_per_seq * page_size = {max_kv_len}]"
            )
        if q_len > kv_len:
            raise ValueError(f"sequence {s}: q_len={q_len} must not exceed kv_lens[{s}]={kv_len}")
        used = page_indices_np[s, : -(-kv_len // page_size)]
        bad = (used < 0) | (used >= num_pages)
        if np.any(bad):
            j = int(np.argmax(bad))
            raise ValueError(
                f"page_indices[{s}, {j}]={used[j]} is outside [0, {num_pages}) "
                f"(sequence {s} uses {used.shape[0]} pages)"
            )
