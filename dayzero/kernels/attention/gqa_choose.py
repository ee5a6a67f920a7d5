"""The one place that picks how `paged_gqa_attention` runs on CUDA: which kernel takes which sequences
of a step, and each kernel's tiles, from host sizes only (the SeqBatch host tuples, head counts, the
device's SM count), never from device values, so that a call does not synchronise and its launches can
be captured in a CUDA graph (a captured plan stays correct for any lengths of the same batch shape: the
kernels read lengths from the device, only the split count and tiles were picked from the host).

Plan: the leading run of sequences with one query each (decodes; the runner orders them first) goes to
the split-KV decode kernel, the rest (prefills, chunked prefills, decodes after a prefill) to the
flash-attention prefill kernel, which handles any query length, or, without a sliding window, when the
prefill work (query x key pairs) reaches FLASH_MIN_PAIRS and torch's FlashAttention-2 takes the call, to
FA2 (_gqa_flash.py)."""

from __future__ import annotations

from dataclasses import dataclass

H200_SMS = 132  # SM count assumed where there is no CUDA device (the interpreter, tests of the rule)
MAX_SPLITS = 64  # KV splits of one decode sequence (the reduce kernel holds them in one tile)
MIN_SPLIT_KEYS = 256  # fewest keys a split reads: below this the reduce costs more than the split gains
# Query x key pairs from which a step's prefills run on FA2, full attention only (H200, bench/attention.py,
# 2026-12-02, Triton vs FA2: 4K prompt 635 vs 793 us, 16K 10,696 vs 7,865 us; a window of 128 over 16K 510 vs
# 1,205 us; 64 x 128 tokens 201 vs 521 us): FA2 gains with length, the crossover between 4K and 16K.
FLASH_MIN_PAIRS = 1 << 26
DECODE_PROGRAMS_PER_SM = 4  # splits until (sequences x kv heads x splits) reaches this many programs per SM


@dataclass(frozen=True)
class DecodeConfig:
    """Split-KV decode: a program per (sequence, kv head, split) reads BLOCK_N keys per step for all the
    group's query heads; splits > 1 writes float32 partials that a reduce kernel combines."""

    splits: int
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class PrefillConfig:
    """Flash-attention prefill: a program per (query tile, kv head); its BLOCK_M rows are
    BLOCK_M // group query tokens x the group's query heads, keys in BLOCK_N tiles."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class Plan:
    decode_seqs: int  # sequences 0 .. decode_seqs - 1 run on the decode kernel (each has one query)
    decode: DecodeConfig | None
    prefill: PrefillConfig | None  # sequences decode_seqs .. num_seqs - 1, when there are any
    flash: bool = False  # those sequences on torch's FlashAttention-2 instead (prefill's tiles unused)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def choose(query_lens: tuple[int, ...], seq_lens: tuple[int, ...], num_q_heads: int, num_kv_heads: int,
           head_dim: int, sliding_window: int | None, sm_count: int = H200_SMS, float32: bool = False,
           flash_ok: bool = False) -> Plan:
    """How a step of these sequences (host lengths) runs; see the module docstring. float32: q is
    float32 (exact products: smaller prefill tiles, which hold twice the bytes and use no tensor cores);
    flash_ok: FA2 can take the call (_gqa_flash.available)."""
    n = len(query_lens)
    decodes = 0
    while decodes < n and query_lens[decodes] == 1:
        decodes += 1
    group = num_q_heads // num_kv_heads
    decode = None
    if decodes:
        keys = max(seq_lens[:decodes])
        if sliding_window is not None:
            keys = min(keys, sliding_window)
        programs = decodes * num_kv_heads
        splits = min(-(-DECODE_PROGRAMS_PER_SM * sm_count // programs), -(-keys // MIN_SPLIT_KEYS), MAX_SPLITS)
        wide = group > 32 or head_dim > 128  # 64+ query rows or 256-dim entries: 8 warps, else they spill
        decode = DecodeConfig(splits=max(1, splits), block_n=32 if head_dim > 128 or group > 64 else 64,
                              num_warps=8 if wide else 4, num_stages=2 if wide else 3)
    prefill = None
    if decodes < n:
        longest = max(query_lens[decodes:])
        # rows = tokens x group heads: up to 128 rows, but no more than the longest query run fills
        block_m = max(16, _pow2(group), min(128, _pow2(longest * group)))
        if float32 or head_dim > 128:  # twice the accumulator or operand bytes: half the rows, else they spill
            prefill = PrefillConfig(block_m=min(block_m, max(64, _pow2(group))), block_n=32, num_warps=8, num_stages=2)
        else:  # 8 warps at 128 rows: two warpgroups of 64 rows, half the registers of 4 warps (238, no spills)
            # Triton 3.6's ptxas (12.8) crashes (SIGSEGV) on 64 x 64 tiles of 32-wide heads, 4 warps, 3+ stages,
            # pages <= 16 (tools/sass_attention_gqa.py, found on a Qwen3.5 test model): 2 stages there
            stages = 2 if block_m == 64 and _pow2(head_dim) == 32 else 3
            prefill = PrefillConfig(block_m=block_m, block_n=64, num_warps=8 if block_m >= 128 else 4, num_stages=stages)
    pairs = sum(t * s for t, s in zip(query_lens[decodes:], seq_lens[decodes:]))
    flash = flash_ok and sliding_window is None and decodes < n and pairs >= FLASH_MIN_PAIRS
    return Plan(decodes, decode, prefill, flash=flash)
