"""varlen_attention's CUDA kernels (dayzero/kernels/vision: torch's varlen_attn and SDPA per image)
against the reference op, MoonViT's head shapes (16 heads of 72) at several image sizes, bf16 and
float32. Skipped without CUDA; on the CPU the reference runs."""

from __future__ import annotations

import pytest
import torch

from dayzero import ops, settings
from dayzero.kernels.vision import choose
from dayzero.ops.registry import REGISTRY
from dayzero.ops.vision import packed_bounds
from tests.kernels.conftest import cuda


def test_registered_for_cuda():
    impl = next(i for i in REGISTRY.get("varlen_attention").kernels if i.backend == "torch")
    assert impl.devices == ("cuda",) and dict(impl.variants).keys() == {"flash", "sdpa"}


@cuda
@pytest.mark.parametrize("variant,dtype", [("flash", torch.bfloat16), ("sdpa", torch.bfloat16),
                                           ("sdpa", torch.float32)])  # flash takes bf16 / fp16 only
def test_kernels_match_the_reference(dtype, variant):
    grids = ((1, 4, 6), (1, 74, 74), (1, 32, 58), (2, 8, 8))
    bounds = packed_bounds(grids)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(bounds[-1], 16, 72, generator=g).to("cuda", dtype) for _ in range(3))
    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    with REGISTRY.force_backend("reference"):
        want = ops.varlen_attention(q, k, v, cu, bounds, 72**-0.5)
    with settings.override(variants={"varlen_attention": variant}):
        assert choose(q, v) == variant
        with REGISTRY.record_calls(by_backend=True) as calls:
            got = ops.varlen_attention(q, k, v, cu, bounds, 72**-0.5)
    assert calls == {"varlen_attention@torch": 1}
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()
