"""The weight layouts the native matmul kernels read, written once at load time on the
host (numpy only): bfloat16 in the AMX tile layout, float32 in 16-column blocks, int8 and
4-bit codes with their float16 scales (models/quant.py's weights), and the bf16 screen of a
float32 LM head's greedy argmax. matmul.py calls the kernels over them.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np


def can_pack_bf16(shape: tuple[int, ...]) -> bool:
    """Whether a [K, N] weight fits the packed layout: K a multiple of 32, N of 16."""
    return len(shape) == 2 and shape[0] % 32 == 0 and shape[1] % 16 == 0


def pack_bf16(w: np.ndarray) -> np.ndarray:
    """A [K, N] bfloat16 weight in the packed layout both matmul kernels read (the AMX
    B-operand layout), [N/16, K/32, 16, 32]: block (n, k) holds rows 32k .. 32k+31 and columns
    16n .. 16n+15 as 16 rows of 16 (even row, odd row) pairs, one 1 KiB tile; blocks of a
    column run contiguous along K, so k-pair p of a column block is the 64 bytes at p * 32."""
    k, n = w.shape
    if not can_pack_bf16(w.shape):
        raise ValueError(f"cannot pack a [{k}, {n}] weight: K must divide by 32 and N by 16")
    blocks = np.asarray(w).reshape(k // 32, 16, 2, n // 16, 16)  # [kb, r, parity, nb, c]
    return np.ascontiguousarray(blocks.transpose(3, 0, 1, 4, 2)).reshape(n // 16, k // 32, 16, 32)


def can_pack_f32(shape: tuple[int, ...]) -> bool:
    """Whether a [K, N] weight fits `pack_f32`: N a multiple of 16."""
    return len(shape) == 2 and shape[1] % 16 == 0


def pack_f32(w: np.ndarray) -> np.ndarray:
    """A [K, N] float32 weight as [N/16, K, 16]: 16-column blocks, each contiguous along K
    (row k of a block is one 64-byte vector)."""
    k, n = w.shape
    if not can_pack_f32(w.shape):
        raise ValueError(f"cannot pack a [{k}, {n}] weight: N must divide by 16")
    return np.ascontiguousarray(np.asarray(w).reshape(k, n // 16, 16).transpose(1, 0, 2))


#: Inputs per int8 group (models/quant.py's GROUP_SIZE, GGUF's block size).
INT8_GROUP = 32


def can_pack_int8(shape: tuple[int, ...]) -> bool:
    """Whether a [K, N] int8 weight fits `pack_int8`: K a multiple of 32, N of 16."""
    return len(shape) == 2 and shape[0] % INT8_GROUP == 0 and shape[1] % 16 == 0


def is_symmetric(w: dict[str, Any]) -> bool:
    """Whether every group's minimum is -128 x its scale (GGUF Q8_0 blocks held as int8): the
    weight is q x scale, and `pack_int8` leaves the minimums out."""
    scale = np.asarray(w["scale"], np.float16)
    minimum = np.asarray(w["min"], np.float16)
    return bool(np.array_equal(minimum, (scale.astype(np.float32) * -128).astype(np.float16)))


def pack_int8(w: dict[str, Any], *, symmetric: bool | None = None) -> np.ndarray:
    """A quantized weight (models/quant.py: int8 codes q [K, ...], float16 scale and min
    [K/32, ...], weight = (q + 128) * scale + min), viewed as [K, N], in the layout the int8
    kernel reads: uint8 [N/16, K/32, 576], for each 16-column block and group of 32 inputs
    the 32 x 16 codes in quads of inputs (byte 64 p + 4 c + j: q of input 4 p + j, column c:
    the operand order of byte dot products), then the 16 float16 scales and the 16 float16
    minimums. A symmetric weight (`is_symmetric`, default: whether it is) is stored without
    the minimums: [N/16, K/32, 544], 5.6% fewer bytes for the kernel to read."""
    q = np.asarray(w["q"])
    k = q.shape[0]
    q = np.ascontiguousarray(q.reshape(k, -1))
    n = q.shape[1]
    scale = np.ascontiguousarray(np.asarray(w["scale"], np.float16).reshape(-1, n))
    minimum = np.ascontiguousarray(np.asarray(w["min"], np.float16).reshape(-1, n))
    if not can_pack_int8(q.shape) or scale.shape[0] != k // INT8_GROUP:
        raise ValueError(
            f"cannot pack a [{k}, {n}] int8 weight with {scale.shape[0]} groups: K must divide "
            f"by {INT8_GROUP} (one group each) and N by 16"
        )
    if symmetric is None:
        symmetric = is_symmetric(w)
    elif symmetric and not is_symmetric(w):
        raise ValueError("cannot pack an int8 weight symmetric: a minimum is not -128 x scale")
    groups, blocks = k // INT8_GROUP, n // 16
    # (group, quad p, j, block, column) -> (block, group, p, column, j)
    codes = q.view(np.uint8).reshape(groups, INT8_GROUP // 4, 4, blocks, 16)
    codes = codes.transpose(3, 0, 1, 4, 2).reshape(blocks, groups, INT8_GROUP * 16)
    scales = scale.view(np.uint8).reshape(groups, blocks, 32).transpose(1, 0, 2)
    parts = [codes, scales]
    if not symmetric:
        parts.append(minimum.view(np.uint8).reshape(groups, blocks, 32).transpose(1, 0, 2))
    return np.ascontiguousarray(np.concatenate(parts, axis=2))


def fits_int4(w: dict[str, Any]) -> bool:
    """Whether a quantized weight's codes (q + 128) all lie in 0..15: GGUF Q4_0 / Q4_1 blocks
    held as int8, which `pack_int4` stores at 4 bits."""
    q = np.asarray(w["q"])
    return q.size > 0 and int(q.max()) <= 15 - 128


def pack_int4(w: dict[str, Any]) -> np.ndarray:
    """A quantized weight whose codes fit 4 bits (`fits_int4`), viewed as [K, N], in the
    layout the int4 kernel reads: uint8 [N/16, K/32, 320], for each 16-column block and group
    of 32 inputs, byte 64 p + 4 c + j (p < 4) holds the code of input 4 p + j (low nibble) and
    of input 16 + 4 p + j (high nibble) of column c, then the 16 float16 scales and the 16
    float16 minimums (as `pack_int8`)."""
    int8 = pack_int8(w, symmetric=False)  # validates the shapes; its scales and minimums kept
    if not fits_int4(w):
        raise ValueError("cannot pack int8 codes outside 0..15 at 4 bits")
    q = np.asarray(w["q"])
    k = q.shape[0]
    codes = (q.reshape(k, -1).astype(np.int16) + 128).astype(np.uint8)
    blocks, groups = int8.shape[:2]
    # (group, half s, quad p, j, block, column): input 16 s + 4 p + j of the group
    codes = codes.reshape(groups, 2, 4, 4, blocks, 16)
    nibbles = codes[:, 0] | (codes[:, 1] << 4)  # (group, p, j, block, column)
    nibbles = nibbles.transpose(3, 0, 1, 4, 2).reshape(blocks, groups, 256)
    return np.ascontiguousarray(np.concatenate([nibbles, int8[:, :, 512:]], axis=2))


def pack_argmax_screen(w: np.ndarray) -> dict[str, np.ndarray]:
    """What `matmul_argmax_screened_f32` needs besides `pack_f32(w)` for a [K, N] float32
    weight: w rounded to bfloat16 in the `pack_bf16` layout, and f32[2, N] column statistics,
    ||w_j|| and ||bf16(w_j) - w_j|| (2-norms, rounded up), the column factors of the bound on
    how far a bf16 product can be from the float32 one."""
    w = np.asarray(w, np.float32)
    if w.ndim != 2 or not can_pack_bf16(w.shape):
        raise ValueError(f"cannot screen a {list(w.shape)} weight: K must divide by 32, N by 16")
    screen = w.astype(ml_dtypes.bfloat16)
    # bf16(w) is within a factor of 2 of w, so bf16(w) - w is exact in float32 (Sterbenz);
    # the sums of squares accumulate in float64 without a float64 copy of w (an LM head's
    # float64 copies took ~0.7 s of start-up).
    diff = screen.astype(np.float32) - w
    norms = np.sqrt(np.einsum("kn,kn->n", w, w, dtype=np.float64))
    errors = np.sqrt(np.einsum("kn,kn->n", diff, diff, dtype=np.float64))
    # Rounded up to float32 (and never 0: the bound also covers subnormals flushed to zero).
    stats = np.stack([np.maximum(norms, 2.0**-30), errors]) * (1 + 2.0**-20)
    return {
        "screen_bf16": pack_bf16(screen),
        "screen_stats": np.nextafter(stats.astype(np.float32), np.inf),
    }
