"""Paged KV storage: the device memory the block pool's ids index, and the views models write through.

Layout
- A model's cache is a set of *streams* (per layer and name: "kv_latent", "k_pe", "index_k", "k",
  "v", ...; one entry per token, entry shape and dtype fixed) and *states* (per layer and name: KDA
  "conv_q" ... and "recurrent"; one fixed-size tensor per request). `probe_layout` finds them by
  running the model once on one token with a recording cache, so model files declare nothing.
- Streams of equal window (None = full attention, W = sliding window) form a cache group
  (dayzero.cache.kv_manager) with its own pool and arena of `num_blocks[g]` pages. A stream holds
  one entry per `rate` tokens (1; a compression ratio for DeepSeek-V4's compressed entries: entry e
  lives in the block of token e * rate), so a block holds block_size / rate of its entries (at least
  one). In group g's page, stream s occupies bytes [offset(s), + entries per block x entry bytes):
  `streams[layer, name]` is a view [num_blocks, entries per block, *entry_shape] of the arena.
- kv_cache_dtype "fp8_e4m3" (`CacheLayout.with_kv_cache_dtype`) stores every floating stream as FP8
  E4M3 with one float32 scale per 128 values of its last dim (an MLA layer's latent 512 + rope key
  64: 596 bytes per token instead of 1152 in bf16); entries are quantized as they are written and
  read back in the model's dtype, so attention sees the FP8-rounded keys, its own included.
- States live in `num_state_slots` request slots followed by `num_snapshots` snapshot slots:
  `states[layer, name]` is [num_state_slots + num_snapshots, *shape].

A step (`StepContext`, built by the runner) carries per cache group and entry rate the slots the new
entries go to and the slots each row reads, right-aligned and padded on the left with the row's first entry (so the
padding holds finite values; attention masks it with `kv_lens`), plus each row's state slot. Models
see only `cache.layers[i]`, a `PagedLayerView`: `append(name, new)` writes and gathers,
`select(name, indices)` reads chosen entries only, `lens(name)` gives the rows' lengths, and
`view[name]` / `view[name] = x` read and write states.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from dayzero.formats.fp8 import dequantize_activation_groups, quantize_activation_groups

if TYPE_CHECKING:
    from dayzero.models.base import CausalLM

ALIGN = 16  # bytes; every stream starts at a multiple of this in a page
FP8_GROUP = 128  # values per scale of an FP8 stream (kv_cache_dtype "fp8_e4m3")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")


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
        return torch.Size(self.shape).numel() * torch.tensor([], dtype=self.dtype).element_size()

    def entries_per_block(self, block_size: int) -> int:
        """Entries one block holds: entry e lives in the block of token e * rate."""
        if self.rate == 1:
            return block_size
        if self.rate <= block_size and block_size % self.rate == 0:
            return block_size // self.rate
        if self.rate % block_size == 0:
            return 1
        raise ValueError(f"block_size {block_size} does not fit layer {self.layer}'s {self.name!r} entries of "
                         f"{self.rate} tokens: use a block size that divides or is a multiple of {self.rate}")


@dataclass(frozen=True)
class StateSpec:
    layer: int
    name: str
    shape: tuple[int, ...]  # one request's state
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * torch.tensor([], dtype=self.dtype).element_size()


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
            n = s.entries_per_block(block_size)
            if s.fp8:
                per_group[self.group_of(s)] += _aligned(n * torch.Size(s.shape).numel())
                per_group[self.group_of(s)] += _aligned(n * 4 * torch.Size(s.scale_shape).numel())
            else:
                per_group[self.group_of(s)] += _aligned(n * s.entry_bytes)
        return per_group

    @property
    def state_bytes(self) -> int:
        """Bytes of one request's (or one snapshot's) state."""
        return sum(s.nbytes for s in self.states)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _ProbeLayer:
    """Records what a layer caches, computing as the reference dict cache does."""

    def __init__(self, layer: int, layout: CacheLayout):
        self.layer, self.layout, self.values = layer, layout, {}

    def append(self, name, new, window=None, rate=1, read=True):
        self.layout.streams.append(StreamSpec(self.layer, name, tuple(new.shape[2:]), new.dtype, window, rate))
        return new

    def lens(self, name):
        return None

    def get(self, name, default=None):
        return self.values.get(name, default)

    def __contains__(self, name):
        return name in self.values

    def __getitem__(self, name):
        return self.values[name]

    def __setitem__(self, name, value):
        if name not in self.values:
            self.layout.states.append(StateSpec(self.layer, name, tuple(value.shape[1:]), value.dtype))
        self.values[name] = value


class _ProbeCache:
    def __init__(self, num_layers: int, layout: CacheLayout):
        self.layers = [_ProbeLayer(i, layout) for i in range(num_layers)]
        self.batch, self.length = 1, 0


@torch.no_grad()
def probe_layout(model: CausalLM) -> CacheLayout:
    """What the model caches, from one forward of one token (the entries' shapes do not depend on
    the tokens)."""
    layout = CacheLayout([], [])
    ids = torch.zeros((1, 1), dtype=torch.long, device=model.device_)
    model(ids, torch.zeros_like(ids), _ProbeCache(model.spec.num_layers, layout))
    return layout


class PagedKVStorage:
    """The arenas and the state slots (module docstring). Zero-filled: unread memory is finite."""

    def __init__(self, layout: CacheLayout, num_blocks: list[int], block_size: int, num_state_slots: int,
                 num_snapshots: int, device: torch.device):
        self.layout, self.num_blocks, self.block_size = layout, list(num_blocks), block_size
        self.page_bytes = layout.page_bytes(block_size)
        self.arenas = [torch.zeros((n, p), dtype=torch.uint8, device=device) for n, p in zip(num_blocks, self.page_bytes)]
        self.specs: dict[tuple[int, str], StreamSpec] = {}
        self.group: dict[tuple[int, str], int] = {}
        self.streams: dict[tuple[int, str], torch.Tensor] = {}
        self.scales: dict[tuple[int, str], torch.Tensor] = {}  # FP8 streams: float32 [blocks, per block, *scale_shape]
        offsets = [0] * len(layout.windows)
        for s in layout.streams:
            g = layout.group_of(s)
            per_block = s.entries_per_block(block_size)

            def carve(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
                n = per_block * torch.Size(shape).numel() * torch.tensor([], dtype=dtype).element_size()
                raw = self.arenas[g][:, offsets[g]:offsets[g] + n]
                offsets[g] += _aligned(n)
                return raw.view(dtype).view(num_blocks[g], per_block, *shape)

            if s.fp8:
                self.streams[s.layer, s.name] = carve(s.shape, torch.float8_e4m3fn)
                self.scales[s.layer, s.name] = carve(s.scale_shape, torch.float32)
            else:
                self.streams[s.layer, s.name] = carve(s.shape, s.dtype)
            self.specs[s.layer, s.name], self.group[s.layer, s.name] = s, g
        self.num_state_slots, self.num_snapshots = num_state_slots, num_snapshots
        slots = num_state_slots + num_snapshots
        self.states = {(s.layer, s.name): torch.zeros((slots, *s.shape), dtype=s.dtype, device=device)
                       for s in layout.states}

    @property
    def nbytes(self) -> int:
        return sum(a.numel() for a in self.arenas) + sum(t.numel() * t.element_size() for t in self.states.values())

    def copy_state(self, src: int, dst: int) -> None:
        """Copy every state tensor's slot src into slot dst (snapshot save and restore)."""
        for t in self.states.values():
            t[dst].copy_(t[src])


@dataclass
class StreamStep:
    """One (group, rate)'s part of a step: where the rows' new entries go, and what each row reads."""

    write_blocks: torch.Tensor  # long [B * new entries per row]
    write_offsets: torch.Tensor  # long [B * new entries per row]
    read_blocks: torch.Tensor  # long [B, S]
    read_offsets: torch.Tensor  # long [B, S]
    lens: torch.Tensor | None  # long [B]: real entries per row (right-aligned), None when no row is padded
    num_new: int  # entries each row appends this step


@dataclass
class StepContext:
    """Everything a forward needs to read and write the paged cache; models never see its insides."""

    streams: dict[tuple[int, int], StreamStep]  # by (group, rate)
    state_slots: torch.Tensor  # long [B]
    fresh: bool  # the rows have no state yet (a prefill from token 0): states read as absent
    batch: int


def build_step(tables: list[list[list[int | None]]], starts: list[int], num_new: int, layout: CacheLayout,
               block_size: int, state_slots: list[int], device) -> StepContext:
    """The StepContext of B rows that each compute num_new tokens from position starts[b], with
    block tables tables[b][group] (None entries: reclaimed blocks, never read). Index arithmetic
    runs on CPU tensors; the results move to `device` once."""
    start = torch.tensor(starts, dtype=torch.long)
    end = start + num_new
    rows = torch.arange(len(tables))[:, None]
    block_tables = {}
    streams = {}
    for g, rate, per_block in layout.stream_kinds(block_size):
        if g not in block_tables:
            width = max(len(t[g]) for t in tables)
            block_tables[g] = torch.tensor([[-1 if b is None else b for b in t[g]] + [-1] * (width - len(t[g]))
                                            for t in tables], dtype=torch.long).view(len(tables), width)
        table = block_tables[g]
        window = layout.windows[g]

        def slots(entries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """(block, offset) of entries [B, n] of this rate: entry e in the block of token e * rate."""
            tokens = entries * rate
            offsets = (tokens % block_size) // rate if per_block > 1 else torch.zeros_like(tokens)
            return table[rows, tokens // block_size], offsets

        first_new, end_entry = start // rate, end // rate
        counts = (end_entry - first_new).unique()
        if len(counts) > 1:
            raise ValueError(f"rows of one step append different numbers of {rate}-token entries "
                             f"({counts.tolist()}); run them as separate forwards")
        wb, wo = slots(first_new[:, None] + torch.arange(int(counts[0])))
        lo = torch.zeros_like(start) if window is None else (start - (window - 1)).clamp(min=0) // rate
        lens = end_entry - lo
        width = int(lens.max())
        entries = end_entry[:, None] - width + torch.arange(width)  # right-aligned
        entries = torch.maximum(entries, lo[:, None])  # padding repeats the row's first entry (finite values)
        rb, ro = slots(entries)
        if width and bool((rb < 0).any()):
            raise RuntimeError("a step reads a block that was reclaimed or never allocated")
        streams[g, rate] = StreamStep(wb.reshape(-1).to(device), wo.reshape(-1).to(device), rb.to(device), ro.to(device),
                                      lens.to(device) if bool((lens != width).any()) else None, int(counts[0]))
    fresh = all(s == 0 for s in starts)
    return StepContext(streams, torch.tensor(state_slots, dtype=torch.long, device=device), fresh, len(tables))


class PagedLayerView:
    """What a layer sees of the paged cache during one step (module docstring)."""

    def __init__(self, storage: PagedKVStorage, ctx: StepContext, layer: int):
        self.storage, self.ctx, self.layer = storage, ctx, layer
        self.dtypes: dict[str, torch.dtype] = {}  # the dtype each stream was written in (FP8 reads return it)

    def _step(self, name: str) -> StreamStep:
        key = (self.layer, name)
        if key not in self.storage.group:
            raise KeyError(f"layer {self.layer} has no cache stream {name!r} (not seen when the layout was probed)")
        return self.ctx.streams[self.storage.group[key], self.storage.specs[key].rate]

    def append(self, name: str, new: torch.Tensor, window: int | None = None, rate: int = 1,
               read: bool = True) -> torch.Tensor | None:
        step = self._step(name)
        pages = self.storage.streams[self.layer, name]
        if new.shape[:2] != (self.ctx.batch, step.num_new):
            raise ValueError(f"layer {self.layer} {name!r}: the step appends {step.num_new} entries per row to "
                             f"{self.ctx.batch} rows, the model gave {tuple(new.shape[:2])}")
        flat = new.reshape(-1, *new.shape[2:])
        key = (self.layer, name)
        if key in self.storage.scales:
            q, sc = quantize_activation_groups(flat, FP8_GROUP)
            pages[step.write_blocks, step.write_offsets] = q
            self.storage.scales[key][step.write_blocks, step.write_offsets] = sc
        else:
            pages[step.write_blocks, step.write_offsets] = flat.to(pages.dtype)
        self.dtypes[name] = new.dtype
        return self._read(name, step.read_blocks, step.read_offsets) if read else None

    def select(self, name: str, indices: torch.Tensor) -> torch.Tensor:
        """Entries [B, N, ...] at indices [B, N] into this step's read layout of `name` (what append
        returns), read through the page table: only these entries are touched."""
        step = self._step(name)
        return self._read(name, step.read_blocks.gather(1, indices), step.read_offsets.gather(1, indices))

    def _read(self, name: str, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        key = (self.layer, name)
        pages = self.storage.streams[key]
        if key not in self.storage.scales:
            return pages[blocks, offsets]
        return dequantize_activation_groups(pages[blocks, offsets], self.storage.scales[key][blocks, offsets],
                                            FP8_GROUP, self.dtypes.get(name, self.storage.specs[key].dtype))

    def lens(self, name: str) -> torch.Tensor | None:
        return self._step(name).lens

    def get(self, name: str, default=None):
        if self.ctx.fresh or (self.layer, name) not in self.storage.states:
            return default
        return self.storage.states[self.layer, name][self.ctx.state_slots]

    def __contains__(self, name: str) -> bool:
        return self.get(name) is not None

    def __getitem__(self, name: str) -> torch.Tensor:
        value = self.get(name)
        if value is None:
            raise KeyError(name)
        return value

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        key = (self.layer, name)
        if key not in self.storage.states:
            raise KeyError(f"layer {self.layer} has no state {name!r} (not seen when the layout was probed)")
        self.storage.states[key][self.ctx.state_slots] = value.to(self.storage.states[key].dtype)


class PagedStepCache:
    """The `cache` argument of one paged forward: `layers[i]` are the views."""

    def __init__(self, storage: PagedKVStorage, ctx: StepContext, num_layers: int):
        self.layers = [PagedLayerView(storage, ctx, i) for i in range(num_layers)]
        self.batch, self.length = ctx.batch, 0
