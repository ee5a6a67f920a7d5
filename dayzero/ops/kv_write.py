"""Writing a step's new cache entries into their paged streams, and the GQA layer's fused form of it.

`write_entries` is the plain write every stream's append uses (dayzero.cache.paged): entries [M, *entry]
to (pages[i], offsets[i]) of data [num_blocks, per_block, *entry], cast to the stream's dtype or, for an
FP8 stream, quantized with one float32 scale per FP8_GROUP values (into scales, same addressing).

`rope_kv_write` (an op) is what a GQA layer does between its QKV projection and attention: RoPE on
the queries and keys (dayzero.ops.rope.rope: float32 arithmetic, rounded to the input dtype), the
rotated keys and the values written into their streams at the step's slots; returns the rotated
queries. Its CUDA kernel does all of it in one launch (dayzero/kernels/token/_kv_write.py)."""

from __future__ import annotations

import torch

from dayzero.formats.fp8 import quantize_activation_groups
from dayzero.ops.registry import reference_op
from dayzero.ops.rope import rope

FP8_GROUP = 128  # values per FP8 scale along an entry's last dim (as the paged storage keeps it)


def write_entries(data: torch.Tensor, scales: torch.Tensor | None, pages: torch.Tensor, offsets: torch.Tensor,
                  new: torch.Tensor) -> None:
    """data[pages[i], offsets[i]] = new[i] (FP8 streams: quantized, the scales beside); no host sync."""
    if scales is not None:
        q, sc = quantize_activation_groups(new, FP8_GROUP, check_finite=False)  # no host sync in a step
        data[pages, offsets] = q
        scales[pages, offsets] = sc
    else:
        data[pages, offsets] = new.to(data.dtype)


@reference_op("rope_kv_write")
def rope_kv_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  interleaved: bool, k_data: torch.Tensor, v_data: torch.Tensor, pages: torch.Tensor,
                  offsets: torch.Tensor, k_scales: torch.Tensor | None = None,
                  v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, Hq, D], k and v [N, Hkv, D] (views of one projection may be strided); cos, sin [N, D/2]
    float32; k_data, v_data [num_blocks, per_block, Hkv, D] the streams (scales: FP8 streams');
    pages, offsets long [N]: each token's slot. Rotates q and k (rope), writes rotated k and v at the
    slots, returns rotated q [N, Hq, D] in q.dtype."""
    n = q.shape[0]
    if k.shape[0] != n or v.shape != k.shape or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"rope_kv_write: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be "
                         "[N, Hq, D], [N, Hkv, D], [N, Hkv, D]")
    if pages.shape != (n,) or offsets.shape != (n,):
        raise ValueError(f"rope_kv_write: pages {tuple(pages.shape)} and offsets {tuple(offsets.shape)} must be "
                         f"[{n}], one slot per token")
    for name, data in (("k_data", k_data), ("v_data", v_data)):
        if tuple(data.shape[2:]) != tuple(k.shape[1:]):
            raise ValueError(f"rope_kv_write: {name} entries {tuple(data.shape[2:])} are not k's "
                             f"[Hkv, D] = {tuple(k.shape[1:])}")
    write_entries(k_data, k_scales, pages, offsets, rope(k, cos, sin, interleaved))
    write_entries(v_data, v_scales, pages, offsets, v)
    return rope(q, cos, sin, interleaved)
