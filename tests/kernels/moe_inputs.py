"""Random routed-expert layers for the kernel tests: never zeros, exact MXFP4 weights."""

from __future__ import annotations

import torch

from dayzero.formats import mxfp4
from dayzero.ops.moe import ExpertWeights, _experts_reference


def random_mxfp4(shape: tuple[int, ...], k: int, gen: torch.Generator, device, scale_range=(119, 124)):
    """(blocks uint8 [*shape, k/32, 16], scales uint8 [*shape, k/32]): uniform random codes and E8M0 bytes.
    On CUDA they are drawn there, from a generator seeded by `gen` (full model shapes are gigabytes)."""
    if torch.device(device).type == "cuda":
        seed = int(torch.randint(0, 2**62, (1,), generator=gen))
        gen = torch.Generator(device=device).manual_seed(seed)
    where = device if torch.device(device).type == "cuda" else "cpu"
    blocks = torch.randint(0, 256, (*shape, k // 32, 16), generator=gen, dtype=torch.uint8, device=where)
    scales = torch.randint(scale_range[0], scale_range[1] + 1, (*shape, k // 32), generator=gen,
                           dtype=torch.uint8, device=where)
    return blocks.to(device), scales.to(device)


def random_routing(tokens: int, experts: int, top_k: int, gen: torch.Generator, device):
    """Distinct experts per token (uniform) and softmax weights in float32."""
    ids = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :top_k]
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=-1)
    return ids.to(device), weights.to(device)


def random_layer(experts: int, hidden: int, inter: int, gen: torch.Generator, device, bias: bool) -> ExpertWeights:
    w13, s13 = random_mxfp4((experts, 2 * inter), hidden, gen, device)
    w2, s2 = random_mxfp4((experts, hidden), inter, gen, device)
    b13 = b2 = None
    if bias:
        b13 = (torch.randn(experts, 2 * inter, generator=gen) * 0.5).to(device, torch.bfloat16)
        b2 = (torch.randn(experts, hidden, generator=gen) * 0.5).to(device, torch.bfloat16)
    return ExpertWeights("mxfp4", w13, w2, s13, s2, b13, b2)


def as_bf16(experts: ExpertWeights) -> ExpertWeights:
    """The same experts dequantized exactly to bf16 (path C's storage)."""
    deq = lambda b, s: torch.stack([mxfp4.dequantize(b[e], s[e], torch.bfloat16) for e in range(b.shape[0])])  # noqa: E731
    return ExpertWeights("bf16", deq(experts.w13, experts.w13_scale), deq(experts.w2, experts.w2_scale),
                         b13=experts.b13, b2=experts.b2)


def exact(x, ids, weights, experts: ExpertWeights, activation) -> torch.Tensor:
    """The layer in float32 on the exact (dequantized) weights: what bf16 kernels approximate."""
    return _experts_reference(x.float(), ids, weights, experts, activation)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()
