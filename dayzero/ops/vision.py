"""Ops of vision encoders (MoonViT): packed bidirectional attention over the patches of several images,
the learned 2D position grid resampled to each image, GELU.

Images are packed: the patches of every image (every frame of a clip, frame by frame, each frame in
raster order, row by row) follow each other in one [N, ...] row, and `cu_seqlens` int32 [S + 1] marks
where image s begins and ends (cu_seqlens[0] = 0, cu_seqlens[S] = N). `cu_seqlens_host` is the same on
the host, so that no op reads the device for it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dayzero.ops.registry import reference_op


def _check_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                  cu_seqlens_host: tuple[int, ...]) -> None:
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"varlen_attention: q, k must be [tokens, heads, dim] alike and v [tokens, heads, dv]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    bounds = list(cu_seqlens_host)
    if (len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != q.shape[0] or any(b > a for a, b in zip(bounds[1:], bounds))
            or tuple(cu_seqlens.shape) != (len(bounds),)):
        raise ValueError(f"varlen_attention: cu_seqlens must rise from 0 to the {q.shape[0]} tokens, one entry more "
                         f"than the sequences; got {bounds} (device tensor {tuple(cu_seqlens.shape)})")


@reference_op("varlen_attention")
def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     cu_seqlens_host: tuple[int, ...], scale: float) -> torch.Tensor:
    """Bidirectional (non-causal) attention inside each packed sequence: token i of sequence s attends to
    every token of s and to nothing else. q, k [N, H, D], v [N, H, Dv] -> [N, H, Dv] in q.dtype.
    Scores softmax(q k^T * scale) in float32."""
    _check_varlen(q, k, v, cu_seqlens, cu_seqlens_host)
    out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    for start, end in zip(cu_seqlens_host[:-1], cu_seqlens_host[1:]):
        if end == start:
            continue
        qs, ks, vs = (t[start:end].float().transpose(0, 1) for t in (q, k, v))  # [H, L, D]
        probs = torch.softmax(qs @ ks.transpose(1, 2) * scale, dim=-1)
        out[start:end] = (probs @ vs).transpose(0, 1).to(q.dtype)
    return out


@reference_op("gelu")
def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU, x * Phi(x) ("none", the erf form) or its tanh approximation ("tanh": transformers'
    `gelu_pytorch_tanh`), in x.dtype."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return F.gelu(x, approximate=approximate)


def time_sincos(num_frames: int, dim: int) -> torch.Tensor:
    """float32 [num_frames, dim]: frame f's fixed 1D embedding [sin(f w_i) | cos(f w_i)], w_i = 10000^(-2i/dim)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.arange(num_frames, dtype=torch.float32)[:, None] * inv_freq
    return torch.cat([angles.sin(), angles.cos()], dim=1)


@reference_op("vision_pos_embed")
def vision_pos_embed(table: torch.Tensor, grids: tuple[tuple[int, int, int], ...], max_frames: int) -> torch.Tensor:
    """The position embedding of every packed patch, [N, D] in table.dtype, N = sum of t * h * w.

    table [H0, W0, D]: the learned grid, resampled to each image's (h, w) patches by bicubic
    interpolation (F.interpolate, align_corners False: the grid's cells and the image's patches span the
    same square; a same-size grid is used as is), the same for every frame. A clip of t > 1 frames also
    gets frame f's fixed sin/cos embedding (`time_sincos`, f < max_frames); a single image gets none.
    Computed in float32."""
    if table.dim() != 3:
        raise ValueError(f"vision_pos_embed: table must be [height, width, dim], got {tuple(table.shape)}")
    h0, w0, dim = table.shape
    grid = table.float().permute(2, 0, 1)[None]  # [1, D, H0, W0]
    parts = []
    for t, h, w in grids:
        if t < 1 or h < 1 or w < 1:
            raise ValueError(f"vision_pos_embed: grid (t, h, w) must be positive, got {(t, h, w)}")
        if t > max_frames:
            raise ValueError(f"vision_pos_embed: {t} frames, the time embedding has {max_frames} (pos_emb_time)")
        spatial = grid if (h, w) == (h0, w0) else F.interpolate(grid, size=(h, w), mode="bicubic", align_corners=False)
        pos = spatial[0].permute(1, 2, 0).reshape(1, h * w, dim).expand(t, h * w, dim)
        if t > 1:
            pos = pos + time_sincos(t, dim).to(table.device)[:, None, :]
        parts.append(pos.reshape(t * h * w, dim))
    return torch.cat(parts).to(table.dtype) if parts else table.new_zeros(0, dim)


def axial_rope_angles(grids: tuple[tuple[int, int, int], ...], head_dim: int, theta: float,
                      device: torch.device | str | None = None) -> torch.Tensor:
    """MoonViT's 2D RoPE: float32 [N, head_dim / 2] angles, one per interleaved pair of a head's dims.
    Pair 2j turns by col * w_j and pair 2j + 1 by row * w_j, w_j = theta^(-4j / head_dim), (row, col) the
    patch's place in its frame (every frame of a clip alike)."""
    if head_dim % 4:
        raise ValueError(f"2D RoPE needs a head dim divisible by 4, got {head_dim}")
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 4, dtype=torch.float32, device=device) / head_dim))
    parts = []
    for t, h, w in grids:
        rows = torch.arange(h, device=device, dtype=torch.float32).repeat_interleave(w).repeat(t)
        cols = torch.arange(w, device=device, dtype=torch.float32).repeat(h * t)
        parts.append(torch.stack([cols[:, None] * inv_freq, rows[:, None] * inv_freq], dim=-1).flatten(1))
    return torch.cat(parts) if parts else torch.zeros(0, head_dim // 2, device=device)


def packed_bounds(grids: tuple[tuple[int, int, int], ...]) -> tuple[int, ...]:
    """cu_seqlens on the host: each image's (every frame's) patches one sequence."""
    bounds = [0]
    for t, h, w in grids:
        bounds.append(bounds[-1] + t * h * w)
    return tuple(bounds)


def attention_flops(grids: tuple[tuple[int, int, int], ...], heads: int, head_dim: int) -> int:
    """FLOPs of varlen_attention (q k^T and probs v) over these images."""
    return sum(4 * heads * head_dim * (t * h * w) ** 2 for t, h, w in grids)

