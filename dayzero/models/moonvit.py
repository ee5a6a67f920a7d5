"""MoonViT, Kimi K2.5's vision tower, and its projector into the text model's hidden size.

Images at native resolution, packed: image i of a batch is a grid of t x h x w patches of
patch_size^2 pixels (t = 1 for an image, t frames for a clip; h and w even), every patch one token.
    x = patch_embed.proj(pixels)                        a p x p, stride p convolution = one matmul per patch
    x = x + pos                                         the learned [H0, W0, D] grid resampled bicubically to
                                                        (h, w), plus a fixed sin/cos per frame of a clip
                                                        (ops.vision_pos_embed)
    27 blocks:  x = x + wo(attn(norm0(x)));  x = x + fc1(gelu_tanh(fc0(norm1(x))))
        attn: q, k, v = split(wqkv(x)) per head; q, k turned by a 2D RoPE (interleaved pairs: pair 2j by
        the patch's column, 2j + 1 by its row, at frequency theta^(-4j / head_dim)); softmax(q k^T /
        sqrt(head_dim)) v over the patches of the same image (all its frames) only: one packed
        bidirectional op for the whole batch (ops.varlen_attention)
    x = final_layernorm(x)
    merge: each 2 x 2 block of patches (merge_kernel_size) becomes one token of the 4 patches' features
        concatenated (row-major inside the block), averaged over a clip's frames: h w / 4 tokens per image
    projector: LayerNorm(D) per patch, then Linear(4D, 4D) -> GELU (erf) -> Linear(4D, text hidden)
LayerNorms: eps 1e-5 (the projector's: projection_layer_norm_eps). Every Linear has a bias.

Checkpoint names as released (Moonshot's `vision_tower.*`, `mm_projector.*`): patch_embed.proj
[D, 3, p, p], patch_embed.pos_emb.weight [H0, W0, D], encoder.blocks.N.{norm0, norm1, wqkv, wo, mlp.fc0,
mlp.fc1}, encoder.final_layernorm; mm_projector.pre_norm, mm_projector.proj.0, mm_projector.proj.2.
wqkv's q and k rows keep the release's interleaved pair order, which is the order ops.rope(interleaved=True)
turns (transformers permutes them to its half-split form at load).
"""

from __future__ import annotations

import torch
from torch import nn

from dayzero import ops
from dayzero.models.base import empty_param
from dayzero.models.layers import LayerNorm, Linear
from dayzero.ops.vision import axial_rope_angles, packed_bounds
from dayzero.spec import VisionSpec

NORM_EPS = 1e-5
ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}  # hidden_act -> ops.gelu's approximate


def vision_options(config: dict) -> dict:
    """The vision config's values VisionSpec does not carry, in transformers' or the remote code's names
    (`vision_config` of a kimi_k25 config.json), with their defaults."""
    v = config.get("vision_config") or {}
    rope = v.get("rope_parameters") or {}
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ACTIVATIONS:
        from dayzero.spec import UnsupportedModelError

        raise UnsupportedModelError("vision_config.hidden_act", act, tuple(ACTIVATIONS), "config.json")
    return {
        "max_frames": int(v.get("pos_emb_time", v.get("init_pos_emb_time", 4))),
        "rope_theta": float(rope.get("rope_theta", 10000.0)),
        "approximate": ACTIVATIONS[act],
        "projector_eps": float(config.get("projection_layer_norm_eps", v.get("projector_ln_eps", 1e-5))),
    }


class VisionBlock(nn.Module):
    def __init__(self, v: VisionSpec, approximate: str, dtype, device):
        super().__init__()
        d = v.hidden_size
        self.heads, self.head_dim, self.approximate = v.num_heads, d // v.num_heads, approximate
        self.norm0 = LayerNorm(d, NORM_EPS, dtype, device)
        self.norm1 = LayerNorm(d, NORM_EPS, dtype, device)
        self.wqkv = Linear(d, 3 * d, bias=True, dtype=dtype, device=device)
        self.wo = Linear(d, d, bias=True, dtype=dtype, device=device)
        self.mlp = nn.Module()
        self.mlp.fc0 = Linear(d, v.intermediate_size, bias=True, dtype=dtype, device=device)
        self.mlp.fc1 = Linear(v.intermediate_size, d, bias=True, dtype=dtype, device=device)

    def attention(self, x: torch.Tensor, cos, sin, cu_seqlens, cu_seqlens_host) -> torch.Tensor:
        q, k, v = self.wqkv(x).view(x.shape[0], 3, self.heads, self.head_dim).unbind(1)
        q, k = ops.rope(q, cos, sin, interleaved=True), ops.rope(k, cos, sin, interleaved=True)
        out = ops.varlen_attention(q, k, v, cu_seqlens, cu_seqlens_host, self.head_dim**-0.5)
        return self.wo(out.reshape(x.shape[0], -1))

    def forward(self, x: torch.Tensor, cos, sin, cu_seqlens, cu_seqlens_host) -> torch.Tensor:
        x = x + self.attention(self.norm0(x), cos, sin, cu_seqlens, cu_seqlens_host)
        return x + self.mlp.fc1(ops.gelu(self.mlp.fc0(self.norm1(x)), self.approximate))


class MoonViT(nn.Module):
    """`vision_tower.*`: pixels of packed images -> their merged patches [tokens, kh * kw * D]."""

    def __init__(self, v: VisionSpec, config: dict, dtype, device):
        super().__init__()
        opts = vision_options(config)
        self.spec, self.max_frames, self.rope_theta = v, opts["max_frames"], opts["rope_theta"]
        d, p = v.hidden_size, v.patch_size
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Module()
        self.patch_embed.proj.weight = empty_param((d, 3, p, p), dtype, device)
        self.patch_embed.proj.bias = empty_param((d,), dtype, device)
        self.patch_embed.pos_emb = nn.Module()
        self.patch_embed.pos_emb.weight = empty_param((*v.pos_emb, d), dtype, device)
        self.encoder = nn.Module()
        self.encoder.blocks = nn.ModuleList(VisionBlock(v, opts["approximate"], dtype, device) for _ in range(v.num_layers))
        self.encoder.final_layernorm = LayerNorm(d, NORM_EPS, dtype, device)

    def forward(self, pixels: torch.Tensor, grids: tuple[tuple[int, int, int], ...]) -> torch.Tensor:
        """pixels [N, 3, p, p] (image by image, frame by frame, patches row-major), grids: (t, h, w) per image."""
        v, proj = self.spec, self.patch_embed.proj
        x = ops.linear(pixels.reshape(pixels.shape[0], -1).to(proj.weight.dtype), proj.weight.flatten(1), proj.bias)
        x = x + ops.vision_pos_embed(self.patch_embed.pos_emb.weight, grids, self.max_frames)
        angles = axial_rope_angles(grids, v.hidden_size // v.num_heads, self.rope_theta, x.device)
        cos, sin = angles.cos(), angles.sin()
        bounds = packed_bounds(grids)
        cu_seqlens = torch.tensor(bounds, dtype=torch.int32).to(x.device, non_blocking=True)
        for block in self.encoder.blocks:
            x = block(x, cos, sin, cu_seqlens, bounds)
        return merge_patches(self.encoder.final_layernorm(x), grids, v.merge_kernel)


def merge_patches(x: torch.Tensor, grids: tuple[tuple[int, int, int], ...], kernel: tuple[int, int]) -> torch.Tensor:
    """[sum t h w, D] -> [sum (h / kh)(w / kw), kh, kw, D] flattened to [tokens, kh * kw * D]: each kh x kw block
    of a frame's patches as one token (row-major inside the block, blocks row-major), averaged over frames."""
    kh, kw = kernel
    out, start = [], 0
    for t, h, w in grids:
        if h % kh or w % kw:
            raise ValueError(f"merge_patches: a {h} x {w} patch grid does not divide into {kh} x {kw} blocks")
        block = x[start:start + t * h * w].view(t, h // kh, kh, w // kw, kw, x.shape[-1])
        merged = block.permute(1, 3, 0, 2, 4, 5).float().mean(dim=2)  # [h/kh, w/kw, kh, kw, D]
        out.append(merged.reshape((h // kh) * (w // kw), kh * kw * x.shape[-1]).to(x.dtype))
        start += t * h * w
    return torch.cat(out) if out else x.new_zeros(0, kh * kw * x.shape[-1])


class Projector(nn.Module):
    """`mm_projector.*`: merged patches [tokens, kh * kw * D] -> the text model's hidden size."""

    def __init__(self, v: VisionSpec, config: dict, dtype, device):
        super().__init__()
        merged = v.hidden_size * v.merge_kernel[0] * v.merge_kernel[1]
        self.patch_dim = v.projector_hidden_size
        if self.patch_dim != v.hidden_size:
            raise ValueError(f"projection_hidden_size {self.patch_dim} must be the vision tower's hidden_size "
                             f"{v.hidden_size} (the projector normalises each patch's features)")
        self.pre_norm = LayerNorm(self.patch_dim, vision_options(config)["projector_eps"], dtype, device)
        self.proj = nn.ModuleDict({"0": Linear(merged, merged, bias=True, dtype=dtype, device=device),
                                   "2": Linear(merged, v.text_hidden_size, bias=True, dtype=dtype, device=device)})

    def forward(self, merged: torch.Tensor) -> torch.Tensor:
        n = merged.shape[0]
        x = self.pre_norm(merged.view(n, -1, self.patch_dim)).view(n, -1)
        return self.proj["2"](ops.gelu(self.proj["0"](x), "none"))
