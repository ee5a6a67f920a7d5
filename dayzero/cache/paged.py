"""Paged KV storage: the device memory the block pool's ids index, and the views models write through.

Layout
- A model's cache is a set of *streams* (per layer and name: "kv_latent", "k_pe", "index_k", "k",
  "v", ...; one entry per token, entry shape and dtype fixed) and *states* (per layer and name: KDA
  "conv_q" ... and "recurrent"; one fixed-size tensor per request): a `CacheLayout` of the spec
  (dayzero/cache/layout.py, which also gives every byte count the memory plan uses). `probe_layout`
  records what a model really writes (one forward of one token with a recording cache);
  `checked_layout` is the spec's layout once the two agree.
- Streams of equal window (None = full attention, W = sliding window) form a cache group
  (dayzero.cache.kv_manager) with its own pool and arena of `num_blocks[g]` pages. A stream holds
  one entry per `rate` tokens (1; a compression ratio for DeepSeek-V4's compressed entries: entry e
  lives in the block of its last token e * rate + rate - 1: dayzero.ops.paged), so a block holds block_size / rate of its entries (at least
  one). In group g's page, stream s occupies bytes [offset(s), + entries per block x entry bytes):
  `streams[layer, name]` is a view [num_blocks, entries per block, *entry_shape] of the arena
  (`StreamSpec.block_bytes` of the page each; the views fill the page exactly).
- kv_cache_dtype "fp8_e4m3" (`CacheLayout.with_kv_cache_dtype`) stores every floating stream as FP8
  E4M3 with one float32 scale per 128 values of its last dim (an MLA layer's latent 512 + rope key
  64: 596 bytes per token instead of 1152 in bf16); entries are quantized as they are written and
  read back in the model's dtype, so attention sees the FP8-rounded keys, its own included.
- States live in `num_state_slots` request slots followed by `num_snapshots` snapshot slots:
  `states[layer, name]` is [num_state_slots + num_snapshots, *shape].
- With `scratch=True` (the engine's storage) every arena has one more page than its pool hands out,
  `scratch_pages[g]`, and the states one more slot, `scratch_slot`: where the padding sequences of a
  CUDA-graph decode step (dayzero.cache.static_step) write and read, so they never touch a request's
  cache.

A step's metadata (`dayzero.cache.step.StepMetadata`, built by the runner in one transfer) carries
the packed batch (SeqBatch), the block table of every cache group and where each new entry goes.
Models see only `cache.layers[i]`, a `PagedLayerView`: `append(name, new)` writes the step's new
entries and returns the stream (`dayzero.ops.paged.PagedStream`) that attention ops read in place
through the block table, `stream(name)` returns it without writing, and `view[name]` /
`view[name] = x` read and write the sequences' states. Nothing gathers a sequence's whole cache.
"""

from __future__ import annotations

import torch

from dayzero.cache.layout import CacheLayout, StateSpec, StreamSpec, align_up, cache_layout
from dayzero.cache.step import StepMetadata
from dayzero import ops
from dayzero.ops.kv_write import write_entries
from dayzero.ops.paged import PagedStream, SeqBatch

class _ProbeLayer:
    """Records what a layer caches while the model runs on one token: each stream it appends to (a
    one-entry page holding the new entry, so the layer's ops run) and each state it sets."""

    def __init__(self, layer: int, layout: CacheLayout, seqs: SeqBatch):
        self.layer, self.layout, self.seqs, self.values, self.streams = layer, layout, seqs, {}, {}

    def append(self, name, new, window=None, rate=1):
        self.layout.streams.append(StreamSpec(self.layer, name, tuple(new.shape[1:]), new.dtype, window, rate))
        data = new.new_zeros((1, 1, *new.shape[1:]))
        data[0, :new.shape[0]] = new[:1]
        table = torch.tensor([[0, -1]], dtype=torch.int32, device=new.device)
        self.streams[name] = PagedStream(data, table, rate, rate)
        return self.streams[name]

    def stream(self, name):
        return self.streams[name]

    def rope_append(self, q, k, v, cos, sin, interleaved, window=None):
        keys, values = self.append("k", k, window), self.append("v", v, window)  # the streams' shapes
        slot = torch.zeros(q.shape[0], dtype=torch.long, device=q.device)
        return ops.rope_kv_write(q, k, v, cos, sin, interleaved, keys.data, values.data, slot, slot), keys, values

    def get(self, name, default=None):
        return self.values.get(name, default)

    def __contains__(self, name):
        return name in self.values

    def __getitem__(self, name):
        return self.values[name]

    def state_pool(self, name, shape, dtype):
        """PagedLayerView.state_pool's (pool, slots) for the probe's one sequence: a zero state in slot 0."""
        if name not in self.values:
            self.layout.states.append(StateSpec(self.layer, name, tuple(shape), dtype))
            self.values[name] = torch.zeros((1, *shape), dtype=dtype, device=self.seqs.seq_lens.device)
        return self.values[name], torch.zeros(1, dtype=torch.long, device=self.seqs.seq_lens.device)

    def __setitem__(self, name, value):
        if name not in self.values:
            self.layout.states.append(StateSpec(self.layer, name, tuple(value.shape[1:]), value.dtype))
        self.values[name] = value


class _ProbeCache:
    def __init__(self, num_layers: int, layout: CacheLayout, device):
        self.seqs = SeqBatch.build([1], [1], device)
        self.layers = [_ProbeLayer(i, layout, self.seqs) for i in range(num_layers)]
        self.logits_indices = None
        self.mm_embeds = None


@torch.no_grad()
def probe_layout(model: torch.nn.Module) -> CacheLayout:
    """What the model caches, from one packed forward of one token (the entries' shapes do not depend
    on the tokens)."""
    layout = CacheLayout([], [])
    ids = torch.zeros((1,), dtype=torch.long, device=model.device_)
    model.forward_packed(ids, torch.zeros_like(ids), _ProbeCache(model.spec.num_layers, layout, model.device_))
    return layout


def checked_layout(model: torch.nn.Module, kv_cache_dtype: str = "auto") -> CacheLayout:
    """`cache_layout` of the model's spec (this rank's share of it) and dtype, after checking that the model writes exactly
    that (else the memory plan and the storage would describe another cache than the one used)."""
    planned, probed = cache_layout(model.cache_spec(), model.dtype), probe_layout(model)
    planned_set = set(map(repr, planned.streams + planned.states))
    probed_set = set(map(repr, probed.streams + probed.states))
    if planned_set != probed_set:
        raise RuntimeError(f"{model.spec.model_type}: the model caches what dayzero/cache/layout.py does not plan "
                           f"(written but not planned: {sorted(probed_set - planned_set)}; planned but not written: "
                           f"{sorted(planned_set - probed_set)}); update layer_layout for this attention kind")
    return planned.with_kv_cache_dtype(kv_cache_dtype)


class PagedKVStorage:
    """The arenas and the state slots (module docstring). Zero-filled: unread memory is finite."""

    def __init__(self, layout: CacheLayout, num_blocks: list[int], block_size: int, num_state_slots: int,
                 num_snapshots: int, device: torch.device, scratch: bool = False):
        self.layout, self.num_blocks, self.block_size = layout, list(num_blocks), block_size
        self.page_bytes = layout.page_bytes(block_size)
        self.scratch_pages = list(num_blocks) if scratch else None  # the page past each pool's last
        pages = [n + int(scratch) for n in num_blocks]
        self.arenas = [torch.zeros((n, p), dtype=torch.uint8, device=device) for n, p in zip(pages, self.page_bytes)]
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
                offsets[g] += align_up(n)
                return raw.view(dtype).view(pages[g], per_block, *shape)

            if s.fp8:
                self.streams[s.layer, s.name] = carve(s.shape, torch.float8_e4m3fn)
                self.scales[s.layer, s.name] = carve(s.scale_shape, torch.float32)
            else:
                self.streams[s.layer, s.name] = carve(s.shape, s.dtype)
            self.specs[s.layer, s.name], self.group[s.layer, s.name] = s, g
        if offsets != self.page_bytes:  # the views fill the pages exactly, as the memory plan counts them
            raise RuntimeError(f"carved {offsets} bytes per page, CacheLayout.page_bytes says {self.page_bytes}")
        self.num_state_slots, self.num_snapshots = num_state_slots, num_snapshots
        slots = num_state_slots + num_snapshots
        self.scratch_slot = slots if scratch else None
        slots += int(scratch)
        self.states = {(s.layer, s.name): torch.zeros((slots, *s.shape), dtype=s.dtype, device=device)
                       for s in layout.states}

    @property
    def nbytes(self) -> int:
        return sum(a.numel() for a in self.arenas) + sum(t.numel() * t.element_size() for t in self.states.values())

    def copy_state(self, src: int, dst: int) -> None:
        """Copy every state tensor's slot src into slot dst (snapshot save and restore)."""
        for t in self.states.values():
            t[dst].copy_(t[src])


class PagedLayerView:
    """What layer `layer` sees of the paged cache during one packed step (module docstring).

    append(name, new [M, *entry]): writes the step's M new entries of stream `name` (sequence by
    sequence; M is what the step's writes for the stream's group and rate hold) and returns the stream
    (a PagedStream that attention ops read in place, this step's entries included);
    stream(name): the stream without writing; view[name] / view[name] = x: the sequences' states
    [B, *shape] (a sequence with no computed token reads zeros; when every sequence of the step is
    fresh, `get` returns the default instead, so a model may skip reading)."""

    def __init__(self, storage: "PagedKVStorage", meta: StepMetadata, layer: int):
        self.storage, self.meta, self.layer = storage, meta, layer

    @property
    def seqs(self) -> SeqBatch:
        return self.meta.seqs

    def _key(self, name: str) -> tuple[int, str]:
        key = (self.layer, name)
        if key not in self.storage.specs:
            raise KeyError(f"layer {self.layer} has no cache stream {name!r} (not seen when the layout was probed)")
        return key

    def stream(self, name: str) -> PagedStream:
        key = self._key(name)
        spec = self.storage.specs[key]
        return PagedStream(self.storage.streams[key], self.meta.block_tables[self.storage.group[key]],
                           self.storage.block_size, spec.rate, self.storage.scales.get(key),
                           spec.dtype if spec.fp8 else None)

    def _place(self, name: str, table: dict | None = None) -> tuple[tuple[int, str], StreamSpec, torch.Tensor, torch.Tensor]:
        """(key, spec, pages, offsets) of stream `name`'s slots in this step: the step's writes, or `table`
        (StepMetadata.candidates) keyed the same way, by (group, rate)."""
        key = self._key(name)
        spec = self.storage.specs[key]
        pages, offsets = (self.meta.writes if table is None else table)[self.storage.group[key], spec.rate]
        return key, spec, pages, offsets

    def _slots(self, name: str, new: torch.Tensor, table: dict | None = None
               ) -> tuple[tuple[int, str], torch.Tensor, torch.Tensor]:
        """(key, pages, offsets) where stream `name` takes this step's entries `new`, checked against them."""
        key, spec, pages, offsets = self._place(name, table)
        if new.shape[0] != pages.shape[0] or tuple(new.shape[1:]) != spec.shape:
            raise ValueError(f"layer {self.layer} {name!r}: the step appends {pages.shape[0]} entries of shape "
                             f"{spec.shape}, the model gave {tuple(new.shape)}")
        return key, pages, offsets

    def _write(self, key: tuple[int, str], pages: torch.Tensor, offsets: torch.Tensor, new: torch.Tensor) -> None:
        write_entries(self.storage.streams[key], self.storage.scales.get(key), pages, offsets, new)

    def append(self, name: str, new: torch.Tensor, window: int | None = None, rate: int = 1) -> PagedStream:
        self._write(*self._slots(name, new), new)
        return self.stream(name)

    def append_part(self, name: str, new: torch.Tensor, start: int) -> PagedStream:
        """Write entries start ... start + len(new) - 1 of what the step appends to stream `name` (a model
        that writes its blocks of sequences one by one: each block's entries before the block reads
        them); the parts of one step must cover its entries once."""
        key, spec, pages, offsets = self._place(name)
        end = start + new.shape[0]
        if start < 0 or end > pages.shape[0] or tuple(new.shape[1:]) != spec.shape:
            raise ValueError(f"layer {self.layer} {name!r}: entries [{start}, {end}) of shape "
                             f"{tuple(new.shape[1:])} do not fit the step's {pages.shape[0]} entries of {spec.shape}")
        self._write(key, pages[start:end], offsets[start:end], new)
        return self.stream(name)

    def append_candidates(self, name: str, new: torch.Tensor) -> PagedStream:
        """A graph decode step's candidate entries [B, *entry] of compressed stream `name`, one per sequence
        (StepMetadata.candidates: the entry's slot where its window completes, the scratch page elsewhere)."""
        self._write(*self._slots(name, new, self.meta.candidates), new)
        return self.stream(name)

    def rope_append(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    interleaved: bool, window: int | None = None) -> tuple[torch.Tensor, PagedStream, PagedStream]:
        """A GQA layer's step: q and k rotated (rope), the rotated keys appended to stream "k" and the
        values to "v" (ops.rope_kv_write, one launch on CUDA); (rotated q, keys, values)."""
        key_k, pages, offsets = self._slots("k", k)
        key_v, _, _ = self._slots("v", v)  # one cache group: the same slots
        streams, scales = self.storage.streams, self.storage.scales
        q = ops.rope_kv_write(q, k, v, cos, sin, interleaved, streams[key_k], streams[key_v], pages, offsets,
                              scales.get(key_k), scales.get(key_v))
        return q, self.stream("k"), self.stream("v")

    def get(self, name: str, default=None):
        if (self.layer, name) not in self.storage.states or all(self.meta.fresh):
            return default
        return self.storage.states[self.layer, name][self.meta.state_slots]

    def __contains__(self, name: str) -> bool:
        return self.get(name) is not None

    def __getitem__(self, name: str) -> torch.Tensor:
        value = self.get(name)
        if value is None:
            raise KeyError(name)
        return value

    def state_pool(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(pool [slots, *shape], the step's sequences' slot numbers long [num_seqs]) of state `name`, for
        ops that read and write the states in place (ops.kda_recurrent_slots): pool[slots[b]] is sequence
        b's state, zero for a fresh sequence (PagedStepCache zeroed the fresh slots). shape and dtype: what
        the layer expects (checked)."""
        key = self._key_state(name)
        pool = self.storage.states[key]
        if tuple(pool.shape[1:]) != tuple(shape) or pool.dtype != dtype:
            raise ValueError(f"layer {self.layer} state {name!r} is {pool.dtype} {tuple(pool.shape[1:])}, the model "
                             f"expects {dtype} {tuple(shape)}")
        return pool, self.meta.state_slots

    def _key_state(self, name: str) -> tuple[int, str]:
        key = (self.layer, name)
        if key not in self.storage.states:
            raise KeyError(f"layer {self.layer} has no state {name!r} (not seen when the layout was probed)")
        return key

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        key = self._key_state(name)
        self.storage.states[key][self.meta.state_slots] = value.to(self.storage.states[key].dtype)


class PagedStepCache:
    """The `cache` argument of one packed forward: `layers[i]` are the views, `meta` the step, and
    `logits_indices` the rows whose logits the forward returns. `mm_embeds`: None, or (rows long [M],
    features [M, hidden]) that take the place of the embeddings of those packed rows (image placeholder
    tokens; vision-language models read it)."""

    def __init__(self, storage: "PagedKVStorage", meta: StepMetadata, num_layers: int):
        self.storage, self.meta = storage, meta
        self.logits_indices = meta.logits_indices
        self.mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None
        self.layers = [PagedLayerView(storage, meta, i) for i in range(num_layers)]
        if storage.states and any(meta.fresh):  # fresh sequences start from zero state: one op per state tensor
            fresh = [s for s, f in zip(meta.state_slots_host, meta.fresh) if f]
            slots = torch.tensor(fresh, dtype=torch.long).to(meta.state_slots.device, non_blocking=True)
            for t in storage.states.values():
                t[slots] = 0

    @property
    def seqs(self) -> SeqBatch:
        return self.meta.seqs
