"""`paged_gqa_attention` on CUDA: the argument checks, `supports`, and the entry that runs the plan
`choose` picks (decode kernel for the leading one-query sequences, prefill kernel or torch's FA2 for the rest).
Contract and arithmetic: dayzero.ops.attention_gqa.paged_gqa_attention (the reference). Nothing here
reads a device value: decisions use the SeqBatch host tuples and tensor metadata only. Importing this
module imports no Triton (the kernels' modules are imported at the first call)."""

from __future__ import annotations

from dataclasses import replace

import torch

from dayzero import settings
from dayzero.kernels.attention.gqa_choose import H200_SMS, Plan, choose
from dayzero.ops.paged import FP8_GROUP, PagedStream, SeqBatch
from dayzero.kernels.devices import triton_cuda

PRIORITY = 10  # above the reference
VARIANTS = {  # of the prefill sequences (DAYZERO_VARIANT=paged_gqa_attention=...); decodes: the Triton decode kernel
    "triton": "flash-attention prefill over the pages in place (Triton)",
    "flash": "torch's FlashAttention-2 (varlen) on keys gathered from the pages; chosen from "
             "gqa_choose.FLASH_MIN_PAIRS query x key pairs",
}

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HEAD_DIM = 256  # one [rows, head_dim] float32 accumulator per program


def _check_stream(name: str, s: PagedStream, q: torch.Tensor, num_seqs: int, max_seq_len: int) -> None:
    if not isinstance(s, PagedStream):
        raise ValueError(f"paged_gqa_attention: {name} must be a PagedStream, got {type(s).__name__}")
    if s.rate != 1 or s.data.dim() != 4:
        raise ValueError(f"paged_gqa_attention: {name} must be a stream of [kv_heads, dim] entries, one per token; "
                         f"got data {tuple(s.data.shape)} at rate {s.rate}")
    if s.data.device != q.device:
        raise ValueError(f"paged_gqa_attention: {name}.data is on {s.data.device}, q on {q.device}")
    if s.data.stride(3) != 1:
        raise ValueError(f"paged_gqa_attention: {name}.data must be contiguous in its last dim, "
                         f"strides {s.data.stride()}")
    if s.per_block != s.block_size:
        raise ValueError(f"paged_gqa_attention: {name}.data holds {s.per_block} entries a page, "
                         f"block_size is {s.block_size}")
    if s.scales is None:
        if s.data.dtype != q.dtype:
            raise ValueError(f"paged_gqa_attention: {name}.data is {s.data.dtype}; it must be q's dtype {q.dtype} "
                             "or float8_e4m3fn with scales")
    else:
        groups = -(-s.data.shape[3] // FP8_GROUP)
        if s.data.dtype != torch.float8_e4m3fn or s.scales.dtype != torch.float32 \
                or tuple(s.scales.shape) != (*s.data.shape[:3], groups) or s.scales.device != q.device:
            raise ValueError(f"paged_gqa_attention: an FP8 {name} needs float8_e4m3fn data and float32 scales "
                             f"{(*s.data.shape[:3], groups)} on {q.device}; got {s.data.dtype} data, "
                             f"{s.scales.dtype} scales {tuple(s.scales.shape)} on {s.scales.device}")
    t = s.block_table
    if t.dtype != torch.int32 or t.dim() != 2 or t.shape[0] < num_seqs or t.device != q.device:
        raise ValueError(f"paged_gqa_attention: {name}.block_table must be int32 [num_seqs={num_seqs}, max_blocks] on "
                         f"{q.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
    if t.shape[1] * s.block_size < max_seq_len or t.stride(1) != 1:
        raise ValueError(f"paged_gqa_attention: {name}.block_table {tuple(t.shape)} (strides {t.stride()}) must be "
                         f"row-contiguous and hold {max_seq_len} tokens in pages of {s.block_size}")


def check(q: torch.Tensor, k: PagedStream, v: PagedStream, seqs: SeqBatch, scale: float,
          sliding_window: int | None = None, sinks: torch.Tensor | None = None) -> None:
    """Raise ValueError naming the argument the kernels cannot take (host metadata only)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.dtype not in DTYPES:
        raise ValueError(f"paged_gqa_attention: q must be [num_tokens, heads, dim] of {DTYPES}, got "
                         f"{getattr(q, 'dtype', type(q).__name__)} {tuple(getattr(q, 'shape', ()))}")
    if q.shape[0] != seqs.num_tokens or q.stride(2) != 1:
        raise ValueError(f"paged_gqa_attention: q {tuple(q.shape)} (strides {q.stride()}) must have "
                         f"num_tokens={seqs.num_tokens} rows and a contiguous last dim")
    for name, t, n in (("query_start", seqs.query_start, seqs.num_seqs + 1),
                       ("seq_lens", seqs.seq_lens, seqs.num_seqs)):
        if t.dtype != torch.int32 or tuple(t.shape) != (n,) or t.device != q.device:
            raise ValueError(f"paged_gqa_attention: seqs.{name} must be int32 [{n}] on {q.device}, "
                             f"got {t.dtype} {tuple(t.shape)} on {t.device}")
    if min(seqs.context_lens, default=0) < 0:
        raise ValueError(f"paged_gqa_attention: seqs has more queries than tokens: query_lens {seqs.query_lens}, "
                         f"seq_lens {seqs.seq_lens_host}")
    for name, s in (("k", k), ("v", v)):
        _check_stream(name, s, q, seqs.num_seqs, seqs.max_seq_len)
    hq, d = q.shape[1], q.shape[2]
    hkv = k.entry_shape[0]
    if v.entry_shape[0] != hkv or hkv == 0 or hq % hkv or k.entry_shape[1] != d:
        raise ValueError(f"paged_gqa_attention: k entries {k.entry_shape} and v entries {v.entry_shape} must share kv "
                         f"heads dividing q's {hq} heads, and k's dim must be q's {d}")
    if max(d, v.entry_shape[1]) > MAX_HEAD_DIM:
        raise ValueError(f"paged_gqa_attention: head dims {d}, {v.entry_shape[1]} exceed {MAX_HEAD_DIM}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"paged_gqa_attention: sliding_window must be an int >= 1 or None, got {sliding_window!r}")
    if not isinstance(scale, (int, float)):
        raise ValueError(f"paged_gqa_attention: scale must be a Python number, got {type(scale).__name__}")
    if sinks is not None and (tuple(sinks.shape) != (hq,) or not sinks.is_floating_point() or sinks.device != q.device):
        raise ValueError(f"paged_gqa_attention: sinks must be float [{hq}] on {q.device}, got "
                         f"{sinks.dtype} {tuple(sinks.shape)} on {sinks.device}")


def supports(q, k, v, seqs, scale, sliding_window=None, sinks=None) -> bool:
    """Whether the kernels take this call (else the registry runs the reference)."""
    try:
        check(q, k, v, seqs, scale, sliding_window, sinks)
    except (ValueError, AttributeError, TypeError):
        return False
    return q.is_cuda


def plan_for(q: torch.Tensor, k: PagedStream, seqs: SeqBatch, sliding_window: int | None,
             v: PagedStream | None = None) -> Plan:
    """The plan `choose` picks for this call on q's device (v: the values, default k's shapes)."""
    v = k if v is None else v
    flash_ok, forced = False, settings.get().variant("paged_gqa_attention")
    if q.is_cuda:
        from dayzero.kernels.attention._gqa_flash import available
        from dayzero.kernels.devices import sm_count

        sms = sm_count(q.device)
        flash_ok = forced != "triton" and not seqs.is_decode and available(q, k, v)  # prefills only
    else:
        sms = H200_SMS
    if forced == "flash" and not flash_ok and not seqs.is_decode:
        raise ValueError(f"DAYZERO_VARIANT: paged_gqa_attention=flash needs torch's FlashAttention-2 to take the call "
                         f"(CUDA sm_80+, fp16/bf16, equal k and v dims <= 256 in multiples of 8); q is {q.dtype} "
                         f"on {q.device}, dims {k.entry_shape[1]} / {v.entry_shape[1]}")
    plan = choose(seqs.query_lens, seqs.seq_lens_host, q.shape[1], k.entry_shape[0], q.shape[2], sliding_window, sms,
                  q.dtype == torch.float32, flash_ok)
    if forced == "flash" and plan.decode_seqs < seqs.num_seqs:
        plan = replace(plan, flash=True)
    return plan


def paged_gqa_attention(q: torch.Tensor, k: PagedStream, v: PagedStream, seqs: SeqBatch, scale: float,
                        sliding_window: int | None = None, sinks: torch.Tensor | None = None, *,
                        plan: Plan | None = None) -> torch.Tensor:
    """[num_tokens, Hq, Dv] in q.dtype, as the reference op; `plan` pins the kernels and tiles (benchmarks,
    tests), else `choose` picks them. Tensors on CUDA, or on the CPU under TRITON_INTERPRET=1."""
    check(q, k, v, seqs, scale, sliding_window, sinks)
    return _run(q, k, v, seqs, scale, sliding_window, sinks, plan)


def _run(q, k, v, seqs, scale, sliding_window=None, sinks=None, plan: Plan | None = None) -> torch.Tensor:
    """paged_gqa_attention on arguments already checked (the registry calls this after `supports`)."""
    from dayzero.kernels.attention._gqa_decode import decode
    from dayzero.kernels.attention._gqa_prefill import prefill

    out = torch.empty((q.shape[0], q.shape[1], v.entry_shape[1]), dtype=q.dtype, device=q.device)
    if q.shape[0] == 0:
        return out
    if plan is None:
        plan = plan_for(q, k, seqs, sliding_window, v)
    n = plan.decode_seqs
    if any(t != 1 for t in seqs.query_lens[:n]) or (n and plan.decode is None) \
            or (n < seqs.num_seqs and plan.prefill is None):
        raise ValueError(f"paged_gqa_attention: plan {plan} does not fit query_lens {seqs.query_lens}: the first "
                         "decode_seqs sequences must have one query each and the rest need a prefill config")
    if n:
        decode(q, k, v, seqs, float(scale), sliding_window, sinks, out, n, plan.decode)
    if n < seqs.num_seqs and plan.flash:
        from dayzero.kernels.attention._gqa_flash import flash_prefill

        flash_prefill(q, k, v, seqs, float(scale), sliding_window, sinks, out, n)
    elif n < seqs.num_seqs:
        prefill(q, k, v, seqs, float(scale), sliding_window, sinks, out, n, plan.prefill)
    return out


def register_gqa(registry) -> None:
    """Register the Triton paged_gqa_attention for CUDA in `registry` (dayzero.ops.registry.Registry)."""
    registry.register_kernel("paged_gqa_attention", _run, backend="triton", devices=["cuda"],
                             priority=PRIORITY, available=triton_cuda, supports=supports, variants=VARIANTS)
