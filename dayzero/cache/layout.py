"""What a model caches and how many bytes the paged storage gives it: the one function of a ModelSpec
that both the engine's storage (dayzero/cache/paged.py) and the memory plan (dayzero/plan.py) use.

- A cache is a set of *streams* (per layer and name; one entry per `rate` tokens, entry shape and
  dtype fixed) and *states* (per layer and name; one fixed-size tensor per request). `cache_layout`
  derives them from the spec, mirroring what each family's model file writes:
      mla / dsa   "kv_latent" [kv_lora_rank], "k_pe" [qk_rope_head_dim] (dsa first "index_k" [index_head_dim])
      gqa / swa   "k", "v" [num_kv_heads, head_dim] (gpt-oss; swa: window sliding_window)
      V4 swa / csa / hca   "window" [head_dim] (window sliding_window); csa and hca add
                  "comp_entries" [head_dim] at rate compress_ratio and the compressor's states
                  "comp_pending_kv"/"comp_pending_gate" [ratio, width] (csa also "comp_prev_*"; width
                  2 x head_dim for csa's overlapping windows); csa's indexer "index_entries"
                  [index_head_dim] and "index_{pending,prev}_{kv,gate}" [ratio, 2 x index_head_dim]
      kda         states "conv_q", "conv_k", "conv_v" [heads x head_dim, conv_kernel - 1] and
                  "recurrent" float32 [heads, head_dim, head_dim]
      gdn         states "conv" [2 x qk heads x head_dim + heads x v_head_dim, conv_kernel - 1] and
                  "recurrent" float32 [heads, head_dim, v_head_dim]
  Streams and states are in the model's dtype unless noted. `probe_layout` (dayzero/cache/paged.py)
  records what a loaded model really writes; `checked_layout` there checks the two agree, for the
  engine and every LocalCache.
- Bytes: a block of `block_size` tokens holds entries_per_block entries of every stream of its
  cache group (streams of equal window); each stream's bytes in a page start at a multiple of
  ALIGN (`CacheLayout.page_bytes`). kv_cache_dtype "fp8_e4m3" stores every floating stream as
  E4M3 plus one float32 scale per FP8_GROUP values of its last dim, values and scales each aligned
  (an MLA latent 512 + rope key 64: 512 + 16 + 64 + 4 = 596 bytes per token instead of 1152 in bf16).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from dayzero.ops.paged import FP8_GROUP  # values per float32 scale of an FP8 stream (kv_cache_dtype "fp8_e4m3")

if TYPE_CHECKING:
    from dayzero.spec import AttentionSpec, ModelSpec

ALIGN = 16  # bytes; every stream (and an FP8 stream's scales) starts at a multiple of this in a page
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
DEFAULT_BLOCK_SIZE = 16  # tokens per block, the engine's default


def _element_size(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class StreamSpec:
    layer: int
    name: str
    shape: tuple[int, ...]  # one entry
    dtype: torch.dtype
    window: int | None  # None: full attention; W: only the last W - 1 entries are read again
    rate: int = 1  # tokens per entry: 1, or a compression ratio (entry e pools tokens [e*rate, (e+1)*rate))
    fp8: bool = False  # stored as float8_e4m3fn with one float32 scale per FP8_GROUP values of the last dim

    @property
    def scale_shape(self) -> tuple[int, ...]:
        return (*self.shape[:-1], -(-self.shape[-1] // FP8_GROUP))

    @property
    def entry_bytes(self) -> int:
        if self.fp8:
            return torch.Size(self.shape).numel() + 4 * torch.Size(self.scale_shape).numel()
        return torch.Size(self.shape).numel() * _element_size(self.dtype)

    def entries_per_block(self, block_size: int) -> int:
        """Entries one block holds: entry e lives in the block of its last token e * rate + rate - 1."""
        if self.rate == 1:
            return block_size
        if self.rate <= block_size and block_size % self.rate == 0:
            return block_size // self.rate
        if self.rate % block_size == 0:
            return 1
        raise ValueError(f"block_size {block_size} does not fit layer {self.layer}'s {self.name!r} entries of "
                         f"{self.rate} tokens: use a block size that divides or is a multiple of {self.rate}")

    def block_bytes(self, block_size: int) -> int:
        """Bytes of this stream in one page: its entries, values and (FP8) scales each aligned."""
        n = self.entries_per_block(block_size)
        if self.fp8:
            return align_up(n * torch.Size(self.shape).numel()) + align_up(n * 4 * torch.Size(self.scale_shape).numel())
        return align_up(n * self.entry_bytes)


@dataclass(frozen=True)
class StateSpec:
    layer: int
    name: str
    shape: tuple[int, ...]  # one request's state
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * _element_size(self.dtype)


@dataclass
class CacheLayout:
    streams: list[StreamSpec]
    states: list[StateSpec]

    def with_kv_cache_dtype(self, kv_cache_dtype: str) -> "CacheLayout":
        """"auto": streams in the model's dtype; "fp8_e4m3": every floating stream in FP8 with a
        float32 scale per 128 values (written quantized, read back in the model's dtype); states
        keep their dtype."""
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported; choose one of {', '.join(KV_CACHE_DTYPES)}")
        if kv_cache_dtype == "auto":
            return self
        return CacheLayout([replace(s, fp8=s.dtype.is_floating_point) for s in self.streams], self.states)

    @cached_property
    def windows(self) -> tuple[int | None, ...]:
        """The cache groups, full attention first."""
        ws = {s.window for s in self.streams}
        return tuple(sorted(ws, key=lambda w: (w is not None, w or 0))) or (None,)

    def group_of(self, stream: StreamSpec) -> int:
        return self.windows.index(stream.window)

    def stream_kinds(self, block_size: int) -> list[tuple[int, int, int]]:
        """(group, rate, entries per block) of every kind of stream, each once (a step's index sets)."""
        if block_size not in self._kinds:
            self._kinds[block_size] = sorted({(self.group_of(s), s.rate, s.entries_per_block(block_size))
                                              for s in self.streams})
        return self._kinds[block_size]

    @cached_property
    def _kinds(self) -> dict[int, list[tuple[int, int, int]]]:
        return {}

    def page_bytes(self, block_size: int) -> list[int]:
        """Bytes of one block of each group: its streams' entries, each stream aligned."""
        per_group = [0] * len(self.windows)
        for s in self.streams:
            per_group[self.group_of(s)] += s.block_bytes(block_size)
        return per_group

    @property
    def state_bytes(self) -> int:
        """Bytes of one request's (or one snapshot's) state."""
        return sum(s.nbytes for s in self.states)

    def sequence_bytes(self, block_size: int) -> tuple[float, int]:
        """(bytes per token, bounded bytes) the storage holds for one decoding sequence: full-attention
        pages per token; per window group the `window_blocks` pages a request keeps, plus its state."""
        pages = self.page_bytes(block_size)
        per_token = sum(p for w, p in zip(self.windows, pages) if w is None) / block_size
        bounded = sum(window_blocks(w, block_size) * p for w, p in zip(self.windows, pages) if w is not None)
        return per_token, bounded + self.state_bytes


def window_blocks(window: int, block_size: int) -> int:
    """Blocks of a sliding-window group one decoding request holds at most: those of its last
    window - 1 tokens and the next token's (dayzero.cache.kv_manager reclaims the older ones)."""
    return -(-(window - 1) // block_size) + 1


# -- the layout of a spec ------------------------------------------------------------------------


def layer_layout(layer: int, a: AttentionSpec, dtype: torch.dtype) -> CacheLayout:
    """The streams and states of one layer (module docstring), in the order the model writes them."""
    streams: list[StreamSpec] = []
    states: list[StateSpec] = []

    def stream(name: str, *shape: int, window: int | None = None, rate: int = 1) -> None:
        streams.append(StreamSpec(layer, name, tuple(shape), dtype, window, rate))

    def state(name: str, *shape: int, state_dtype: torch.dtype = dtype) -> None:
        states.append(StateSpec(layer, name, tuple(shape), state_dtype))

    if a.kind in ("mla", "dsa"):
        if a.kind == "dsa":
            stream("index_k", a.index_head_dim)
        stream("kv_latent", a.kv_lora_rank)
        stream("k_pe", a.qk_rope_head_dim)
    elif a.kind in ("swa", "gqa") and a.o_groups is None:  # gpt-oss: K and V per KV head
        window = a.sliding_window if a.kind == "swa" else None
        stream("k", a.num_kv_heads, a.head_dim, window=window)
        stream("v", a.num_kv_heads, a.head_dim, window=window)
    elif a.kind in ("swa", "csa", "hca"):  # DeepSeek-V4: one shared K=V head, a window, compressed entries
        stream("window", a.head_dim, window=a.sliding_window)
        if a.kind != "swa":
            ratio, overlap = a.compress_ratio, a.kind == "csa"
            stream("comp_entries", a.head_dim, rate=ratio)
            width = 2 * a.head_dim if overlap else a.head_dim
            for part in ("pending", "prev") if overlap else ("pending",):
                state(f"comp_{part}_kv", ratio, width)
                state(f"comp_{part}_gate", ratio, width)
            if overlap:
                stream("index_entries", a.index_head_dim, rate=ratio)
                for part in ("pending", "prev"):
                    state(f"index_{part}_kv", ratio, 2 * a.index_head_dim)
                    state(f"index_{part}_gate", ratio, 2 * a.index_head_dim)
    elif a.kind == "kda":
        proj = a.num_heads * a.head_dim
        for name in ("conv_q", "conv_k", "conv_v"):
            state(name, proj, a.conv_kernel - 1)
        state("recurrent", a.num_heads, a.head_dim, a.head_dim, state_dtype=torch.float32)
    elif a.kind == "gdn":  # one convolution over q | k | v; the state per value head
        state("conv", 2 * a.num_kv_heads * a.head_dim + a.num_heads * a.v_head_dim, a.conv_kernel - 1)
        state("recurrent", a.num_heads, a.head_dim, a.v_head_dim, state_dtype=torch.float32)
    else:
        raise ValueError(f"layer {layer}: no cache layout for attention kind {a.kind!r}")
    return CacheLayout(streams, states)


def cache_layout(spec: ModelSpec, dtype: torch.dtype = torch.bfloat16, kv_cache_dtype: str = "auto") -> CacheLayout:
    """The cache of a model of this spec computing in `dtype`, stored as kv_cache_dtype."""
    streams: list[StreamSpec] = []
    states: list[StateSpec] = []
    for layer in spec.layers:
        part = layer_layout(layer.index, layer.attention, dtype)
        streams += part.streams
        states += part.states
    return CacheLayout(streams, states).with_kv_cache_dtype(kv_cache_dtype)
