"""The cross-layer FP8 expert workspace of path B: one pre-allocated pool of expert slots shared by
every MoE layer, holding experts converted from MXFP4 (_fp8.py) until evicted. The engine makes one per
device, sized by choose.workspace_bytes (0: none), and hands it to the model's MoE layers, which pass it
with their weights (ExpertWeights.workspace); nothing here is process-wide.

Pool (allocated at the first call, for one expert shape [2I, H] at a time):
    w13 float8_e4m3fn [slots, 2I, H], w13_scale float32 [slots, 2I, ceil(H/128)]
    w2  float8_e4m3fn [slots, H, I],  w2_scale  float32 [slots, H, ceil(I/128)]
    slots = capacity bytes // bytes per expert (2I*H + H*I + 4 * scale count); a layer whose experts
    have another shape empties the pool and lays it out anew (models do not mix expert shapes).
Map: (layer key, expert id) -> slot, least recently used first. A layer is its w13 tensor (the model's
parameter: an ExpertWeights built anew per call is the same layer), keyed by a counter handed out at its
first call; a weak reference drops the key and frees its slots when the tensor is collected, so a new
tensor at a recycled id() never sees another layer's slots. A layer's weights must not change while
their experts are in the pool (call clear() after reloading).

One call (`prepare`), on the host:
    1. the current stream waits for the side stream's prefetch (its writes may target any slot);
    2. the call's active experts: torch.unique(topk_ids) -> host (the one synchronisation of path B);
       more active experts than slots raises ValueError naming the size setting;
    3. hits move to the most-recent end; misses take free slots, else evict the least recently used
       entries that this call does not use, and are converted on the current stream (one launch per
       projection);
    4. prefetch (with `prefetch`, CUDA only): the layer that ran after this one last time (call order
       is recorded as layer -> next layer) is expected next; the experts it used at its last call that
       are not resident are converted on a side stream, into slots this call and that layer do not use,
       after an event recorded on the current stream here, so it overlaps this call's GEMMs and
       follows every earlier reader of those slots. Off CUDA (the interpreter tests) it runs inline.
Returns slot_of_expert, int32 [E] on the device (slot of each active expert; 0 elsewhere, never read).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from dayzero.formats.mxfp4 import as_e8m0_bytes
from dayzero.kernels.moe.choose import FP8_GROUP as GROUP
from dayzero.kernels.moe.choose import expert_slot_bytes

SIZE_SETTING = "DAYZERO_FP8_WORKSPACE_GIB (or LLM(fp8_workspace_gib=))"


@dataclass
class WorkspaceStats:
    """Counters since the workspace was made (or reset_stats). Lookups = hits + misses, one per active
    expert of a call; conversions = misses + prefetched; bytes_converted counts FP8 values and scales
    written; prefetch_hits are lookups served by a prefetched expert at its first use."""

    hits: int = 0
    misses: int = 0
    conversions: int = 0
    evictions: int = 0
    bytes_converted: int = 0
    prefetched: int = 0
    prefetch_hits: int = 0
    out_of_window_blocks: int = 0  # MXFP4 blocks converted lossily (mxfp4_fp8's window)

    @property
    def hit_rate(self) -> float:
        return self.hits / max(1, self.hits + self.misses)

    @property
    def prefetch_hit_rate(self) -> float:
        """Fraction of prefetched experts that a later call used."""
        return self.prefetch_hits / max(1, self.prefetched)


@dataclass
class _Entry:
    slot: int
    prefetched: bool = False  # converted ahead and not used yet


class _Layer:
    """What the workspace keeps of a layer between calls: weak references to its MXFP4 tensors (the
    prefetch converts from them), so that holding it keeps no weights alive."""

    def __init__(self, experts, on_collect):
        self._refs = tuple(weakref.ref(t, on_collect) for t in (experts.w13, experts.w13_scale, experts.w2,
                                                                 experts.w2_scale))

    def tensors(self):
        """(w13, w13_scale, w2, w2_scale), or None once any of them was collected."""
        tensors = tuple(r() for r in self._refs)
        return None if any(t is None for t in tensors) else tensors


class _Tensors:
    """The four MXFP4 tensors of a layer, as _convert reads them."""

    def __init__(self, w13, w13_scale, w2, w2_scale):
        self.w13, self.w13_scale, self.w2, self.w2_scale = w13, w13_scale, w2, w2_scale


class Fp8Workspace:
    """See the module docstring. capacity_bytes bounds the pool; device: where it lives; prefetch: convert
    the next layer's experts ahead, on a side stream (CUDA)."""

    def __init__(self, capacity_bytes: int, device: torch.device | str, prefetch: bool = True):
        self.capacity_bytes = int(capacity_bytes)
        self.device = torch.device(device)
        self.prefetch = prefetch
        self._shape: tuple[int, int] | None = None
        self.w13 = self.w13_scale = self.w2 = self.w2_scale = None
        self._out_of_window = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._entries: OrderedDict[tuple[int, int], _Entry] = OrderedDict()
        self._resident: dict[int, int] = {}  # layer key -> experts of it in the pool
        self._free: list[int] = []
        self._keys = 0
        self._ids: dict[int, int] = {}  # id(w13) -> layer key
        self._layers: dict[int, _Layer] = {}  # layer key -> its tensors' references
        self._dead: list[int] = []
        self._next: dict[int, int] = {}  # layer key -> key of the layer called after it
        self._last_used: dict[int, list[int]] = {}
        self._last_key: int | None = None
        self._side_stream = None
        self._pending = None  # event of the last prefetch on the side stream
        self._stats = WorkspaceStats()

    # -- sizes ----------------------------------------------------------------------------------
    @staticmethod
    def _expert_shape(experts) -> tuple[int, int]:
        return experts.w13.shape[1] // 2, experts.w2.shape[1]  # (I, H)

    def num_slots_for(self, experts) -> int:
        """Slots the pool has (or would have) for this layer's expert shape."""
        return self.capacity_bytes // expert_slot_bytes(*self._expert_shape(experts))

    @property
    def num_slots(self) -> int:
        return len(self._free) + len(self._entries) if self._shape else 0

    # -- stats ------------------------------------------------------------------------------------
    @property
    def stats(self) -> WorkspaceStats:
        """A copy of the counters; reads the out-of-window count from the device (synchronises)."""
        s = WorkspaceStats(**vars(self._stats))
        s.out_of_window_blocks = int(self._out_of_window.item())
        return s

    def reset_stats(self) -> None:
        self._stats = WorkspaceStats()
        self._out_of_window.zero_()

    def clear(self) -> None:
        """Forget every converted expert (the pool stays allocated); counts as evictions."""
        self._sync_prefetch()
        self._stats.evictions += len(self._entries)
        self._free = sorted([e.slot for e in self._entries.values()] + self._free)
        self._entries.clear()
        self._resident.clear()

    def _known_key(self, experts) -> int | None:
        key = self._ids.get(id(experts.w13))
        if key is None:
            return None
        tensors = self._layers[key].tensors()
        return key if tensors is not None and tensors[0] is experts.w13 else None

    def resident(self, experts) -> list[int]:
        """Expert ids of this layer held in the pool, least recently used first."""
        key = self._known_key(experts)
        return [] if key is None else [e for (k, e) in self._entries if k == key]

    def holds_layer(self, experts) -> bool:
        """Whether every expert of the layer is in the pool (a call then converts nothing); O(1)."""
        key = self._known_key(experts)
        return key is not None and self._resident.get(key, 0) == experts.num_experts

    # -- entries ----------------------------------------------------------------------------------
    def _add(self, key: int, expert: int, entry: _Entry) -> None:
        self._entries[(key, expert)] = entry
        self._resident[key] = self._resident.get(key, 0) + 1

    def _pop(self, entry_key: tuple[int, int]) -> _Entry:
        self._resident[entry_key[0]] -= 1
        return self._entries.pop(entry_key)

    # -- layers -----------------------------------------------------------------------------------
    def _layer_key(self, experts) -> int:
        for key in self._dead:
            self._drop_layer(key)
        self._dead.clear()
        key = self._known_key(experts)
        if key is not None:
            return key
        key = self._keys
        self._keys += 1
        self._ids[id(experts.w13)] = key
        self._layers[key] = _Layer(experts, lambda _, k=key: self._dead.append(k))
        return key

    def _drop_layer(self, key: int) -> None:
        if self._layers.pop(key, None) is None:
            return  # dropped already (more than one of its tensors was collected)
        for ident in [i for i, k in self._ids.items() if k == key]:
            del self._ids[ident]
        self._last_used.pop(key, None)
        for entry_key in [ek for ek in self._entries if ek[0] == key]:
            self._free.append(self._pop(entry_key).slot)
            self._stats.evictions += 1
        self._resident.pop(key, None)

    def _ensure_pool(self, experts) -> None:
        shape = self._expert_shape(experts)
        if shape == self._shape:
            return
        inter, hidden = shape
        slots = self.num_slots_for(experts)
        if slots == 0:
            raise ValueError(f"the FP8 expert workspace ({self.capacity_bytes / 2**30:.2f} GiB) cannot hold one "
                             f"expert of {expert_slot_bytes(inter, hidden) / 2**20:.1f} MiB; raise {SIZE_SETTING}")
        self._sync_prefetch()
        self._stats.evictions += len(self._entries)
        self._entries.clear()
        self._resident.clear()
        self.w13 = self.w13_scale = self.w2 = self.w2_scale = None  # free the old pool first
        cdiv = lambda a, b: -(-a // b)  # noqa: E731
        dev, fp8 = self.device, torch.float8_e4m3fn
        self.w13 = torch.empty(slots, 2 * inter, hidden, dtype=fp8, device=dev)
        self.w13_scale = torch.empty(slots, 2 * inter, cdiv(hidden, GROUP), dtype=torch.float32, device=dev)
        self.w2 = torch.empty(slots, hidden, inter, dtype=fp8, device=dev)
        self.w2_scale = torch.empty(slots, hidden, cdiv(inter, GROUP), dtype=torch.float32, device=dev)
        self._free = list(range(slots))
        self._shape = shape

    # -- one call ---------------------------------------------------------------------------------
    def prepare(self, experts, topk_ids: torch.Tensor) -> torch.Tensor:
        """Make every expert that topk_ids uses resident; returns slot_of_expert (module docstring)."""
        key = self._layer_key(experts)
        self._ensure_pool(experts)
        self._wait_prefetch()
        E = experts.num_experts
        active = [e for e in torch.unique(topk_ids).tolist() if 0 <= e < E]  # host synchronisation
        if len(active) > self.num_slots:
            I, H = self._shape
            raise ValueError(
                f"the FP8 expert workspace has {self.num_slots} slots ({self.capacity_bytes / 2**30:.2f} GiB) but this "
                f"call activates {len(active)} experts; raise {SIZE_SETTING} to at least "
                f"{len(active) * expert_slot_bytes(I, H) / 2**30:.2f} GiB, or leave the kernel choice to the "
                f"library (it runs path B only where the workspace holds the whole layer)")
        current = {(key, e) for e in active}
        misses = []
        for e in active:
            entry = self._entries.get((key, e))
            if entry is None:
                misses.append(e)
                continue
            self._entries.move_to_end((key, e))
            self._stats.hits += 1
            if entry.prefetched:
                entry.prefetched = False
                self._stats.prefetch_hits += 1
        self._stats.misses += len(misses)
        slots = [self._take_slot(current) for _ in misses]
        for e, slot in zip(misses, slots):
            self._add(key, e, _Entry(slot))
        self._convert(experts, misses, slots)

        slot_of_expert = [0] * E
        for e in active:
            slot_of_expert[e] = self._entries[(key, e)].slot
        if self._last_key is not None and self._last_key != key:
            self._next[self._last_key] = key
        self._last_key = key
        self._last_used[key] = active
        self._prefetch_after(key, current)
        return torch.tensor(slot_of_expert, dtype=torch.int32, device=self.device)

    def _take_slot(self, protected: set) -> int | None:
        if self._free:
            return self._free.pop()
        for entry_key in self._entries:  # least recently used first
            if entry_key not in protected:
                self._stats.evictions += 1
                return self._pop(entry_key).slot
        return None

    def _convert(self, experts, ids: list[int], slots: list[int]) -> None:
        from dayzero.kernels.moe._fp8 import convert_mxfp4_to_fp8

        if not ids:
            return
        ids_t = torch.tensor(ids, dtype=torch.int32, device=self.device)
        slots_t = torch.tensor(slots, dtype=torch.int32, device=self.device)
        convert_mxfp4_to_fp8(experts.w13, as_e8m0_bytes(experts.w13_scale, "experts.w13_scale"), ids_t, slots_t,
                             self.w13, self.w13_scale, self._out_of_window)
        convert_mxfp4_to_fp8(experts.w2, as_e8m0_bytes(experts.w2_scale, "experts.w2_scale"), ids_t, slots_t,
                             self.w2, self.w2_scale, self._out_of_window)
        self._stats.conversions += len(ids)
        self._stats.bytes_converted += len(ids) * expert_slot_bytes(*self._shape)

    # -- prefetch ---------------------------------------------------------------------------------
    def _prefetch_after(self, key: int, current: set) -> None:
        nxt = self._next.get(key)
        if not self.prefetch or nxt is None or nxt not in self._last_used or nxt not in self._layers:
            return
        tensors = self._layers[nxt].tensors()
        if tensors is None:
            return
        experts = _Tensors(*tensors)
        if self._expert_shape(experts) != self._shape:
            return
        wanted = self._last_used[nxt]
        protected = current | {(nxt, e) for e in wanted}
        missing = []
        for e in wanted:
            if (nxt, e) in self._entries:
                self._entries.move_to_end((nxt, e))
            else:
                missing.append(e)
        ids, slots = [], []
        for e in missing:
            slot = self._take_slot(protected)
            if slot is None:
                break
            ids.append(e)
            slots.append(slot)
            self._add(nxt, e, _Entry(slot, prefetched=True))
        if not ids:
            return
        self._stats.prefetched += len(ids)
        if self.device.type != "cuda":
            self._convert(experts, ids, slots)
            return
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(self.device)
        ready = torch.cuda.current_stream(self.device).record_event()
        with torch.cuda.stream(self._side_stream):
            self._side_stream.wait_event(ready)  # every earlier reader of these slots is enqueued before
            self._convert(experts, ids, slots)
            self._pending = self._side_stream.record_event()

    def _wait_prefetch(self) -> None:
        if self._pending is not None:
            torch.cuda.current_stream(self.device).wait_event(self._pending)
            self._pending = None

    def _sync_prefetch(self) -> None:
        if self._pending is not None:
            self._pending.synchronize()
            self._pending = None
