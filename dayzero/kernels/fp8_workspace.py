"""The cross-layer FP8 expert workspace of path B: one pre-allocated pool of expert slots shared by
every MoE layer, holding experts converted from MXFP4 (dayzero.kernels.moe_fp8) until evicted.

Pool (allocated at the first call, for one expert shape [2I, H] at a time):
    w13 float8_e4m3fn [slots, 2I, H], w13_scale float32 [slots, 2I, ceil(H/128)]
    w2  float8_e4m3fn [slots, H, I],  w2_scale  float32 [slots, H, ceil(I/128)]
    slots = capacity bytes // bytes per expert (2I*H + H*I + 4 * scale count); a layer whose experts
    have another shape empties the pool and lays it out anew (models do not mix expert shapes).
Map: (layer key, expert id) -> slot, least recently used first. The layer key is a counter handed to
each ExpertWeights object at its first call; a weak reference drops the key and frees its slots when
the object is collected, so a new object at a recycled id() never sees another layer's slots.
A layer's weights must not change while their experts are in the pool (call clear() after reloading).

One call (`prepare`), on the host:
    1. the current stream waits for the side stream's prefetch (its writes may target any slot);
    2. the call's active experts: torch.unique(topk_ids) -> host (the one synchronisation of path B);
       more active experts than slots raises ValueError naming DAYZERO_FP8_WORKSPACE_GIB;
    3. hits move to the most-recent end; misses take free slots, else evict the least recently used
       entries that this call does not use, and are converted on the current stream (one launch per
       projection);
    4. prefetch (with `prefetch`, CUDA only): the layer that ran after this one last time (call order
       is recorded as layer -> next layer) is expected next; the experts it used at its last call that
       are not resident are converted on a side stream, into slots this call and that layer do not use,
       after an event recorded on the current stream here, so it overlaps this call's GEMMs and
       follows every earlier reader of those slots. Off CUDA (the interpreter tests) it runs inline.
Returns slot_of_expert, int32 [E] on the device (slot of each active expert; 0 elsewhere, never read).

Size: DAYZERO_FP8_WORKSPACE_GIB (GiB), else DEFAULT_WORKSPACE_GIB capped at half the device memory
free when the default workspace is made; `configure_default_workspace(gib=...)` sets it from a memory
plan, and `planned_workspace_bytes()` is what a plan should reserve for it.
"""

from __future__ import annotations

import os
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

WORKSPACE_GIB_ENV = "DAYZERO_FP8_WORKSPACE_GIB"
PREFETCH_ENV = "DAYZERO_FP8_PREFETCH"
DEFAULT_WORKSPACE_GIB = 8.0  # one layer of gpt-oss-120b (128 x 25.7 MB) or DeepSeek-V4 (256 x 26 MB) and more
GROUP = 128


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


def expert_slot_bytes(inter: int, hidden: int) -> int:
    """Bytes of one converted expert: FP8 values of w13 and w2 and their float32 scales."""
    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    return 3 * inter * hidden + 4 * (2 * inter * cdiv(hidden, GROUP) + hidden * cdiv(inter, GROUP))


class Fp8Workspace:
    """See the module docstring. capacity_bytes bounds the pool; device: where it lives."""

    def __init__(self, capacity_bytes: int, device: torch.device | str, prefetch: bool = True):
        self.capacity_bytes = int(capacity_bytes)
        self.device = torch.device(device)
        self.prefetch = prefetch
        self._shape: tuple[int, int] | None = None
        self.w13 = self.w13_scale = self.w2 = self.w2_scale = None
        self._out_of_window = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._entries: OrderedDict[tuple[int, int], _Entry] = OrderedDict()
        self._free: list[int] = []
        self._keys = 0
        self._layers: dict[int, tuple[weakref.ref, int]] = {}  # id(experts) -> (ref, key)
        self._refs: dict[int, weakref.ref] = {}  # key -> ref
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

    def resident(self, experts) -> list[int]:
        """Expert ids of this layer held in the pool, least recently used first."""
        found = self._layers.get(id(experts))
        if found is None or found[0]() is not experts:
            return []
        return [e for (k, e) in self._entries if k == found[1]]

    # -- layers -----------------------------------------------------------------------------------
    def _layer_key(self, experts) -> int:
        for key in self._dead:
            self._drop_layer(key)
        self._dead.clear()
        found = self._layers.get(id(experts))
        if found is not None and found[0]() is experts:
            return found[1]
        key = self._keys
        self._keys += 1
        ref = weakref.ref(experts, lambda _, k=key: self._dead.append(k))
        self._layers[id(experts)] = (ref, key)
        self._refs[key] = ref
        return key

    def _drop_layer(self, key: int) -> None:
        for ident, (_, k) in list(self._layers.items()):
            if k == key:
                del self._layers[ident]
        self._refs.pop(key, None)
        self._last_used.pop(key, None)
        for entry_key in [ek for ek in self._entries if ek[0] == key]:
            self._free.append(self._entries.pop(entry_key).slot)
            self._stats.evictions += 1

    def _ensure_pool(self, experts) -> None:
        shape = self._expert_shape(experts)
        if shape == self._shape:
            return
        inter, hidden = shape
        slots = self.num_slots_for(experts)
        if slots == 0:
            raise ValueError(f"the FP8 expert workspace ({self.capacity_bytes / 2**30:.2f} GiB) cannot hold one "
                             f"expert of {expert_slot_bytes(inter, hidden) / 2**20:.1f} MiB; raise "
                             f"{WORKSPACE_GIB_ENV} or configure_default_workspace(gib=...)")
        self._sync_prefetch()
        self._stats.evictions += len(self._entries)
        self._entries.clear()
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
                f"call activates {len(active)} experts; raise {WORKSPACE_GIB_ENV} to at least "
                f"{len(active) * expert_slot_bytes(I, H) / 2**30:.2f} or route such calls to path A "
                f"(DAYZERO_MOE_PATH=auto does)")
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
            self._entries[(key, e)] = _Entry(slot)
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
                return self._entries.pop(entry_key).slot
        return None

    def _convert(self, experts, ids: list[int], slots: list[int]) -> None:
        from dayzero.formats.mxfp4 import as_e8m0_bytes
        from dayzero.kernels.moe_fp8 import convert_mxfp4_to_fp8

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
        if not self.prefetch or nxt is None or nxt not in self._last_used:
            return
        experts = self._refs[nxt]()
        if experts is None or self._expert_shape(experts) != self._shape:
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
            self._entries[(nxt, e)] = _Entry(slot, prefetched=True)
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


_DEFAULT: dict[torch.device, Fp8Workspace] = {}
_CONFIG: dict[str, float | bool | None] = {"gib": None, "prefetch": None}


def planned_workspace_bytes(device: torch.device | str = "cuda") -> int:
    """Bytes the default workspace of `device` takes (or will take): the setting, else the default
    capped at half the free device memory. What a memory plan should reserve before sizing the KV pool."""
    device = _normalize(device)
    if device in _DEFAULT:
        return _DEFAULT[device].capacity_bytes
    gib = _CONFIG["gib"]
    if gib is None and os.environ.get(WORKSPACE_GIB_ENV):
        try:
            gib = float(os.environ[WORKSPACE_GIB_ENV])
        except ValueError:
            raise ValueError(f"{WORKSPACE_GIB_ENV} must be a number of GiB, got {os.environ[WORKSPACE_GIB_ENV]!r}") from None
    if gib is not None:
        return int(gib * 2**30)
    nbytes = int(DEFAULT_WORKSPACE_GIB * 2**30)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        nbytes = min(nbytes, free // 2)
    return nbytes


def _normalize(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _prefetch_setting() -> bool:
    if _CONFIG["prefetch"] is not None:
        return bool(_CONFIG["prefetch"])
    return os.environ.get(PREFETCH_ENV, "1") != "0"


def default_workspace(device: torch.device | str) -> Fp8Workspace:
    """The process-wide workspace of `device`, made at first use (sizes: planned_workspace_bytes)."""
    device = _normalize(device)
    if device not in _DEFAULT:
        _DEFAULT[device] = Fp8Workspace(planned_workspace_bytes(device), device, prefetch=_prefetch_setting())
    return _DEFAULT[device]


def configure_default_workspace(gib: float | None = None, prefetch: bool | None = None) -> None:
    """Set the default workspaces' size (GiB; None: environment or default) and prefetch policy;
    drops the existing ones (their converted experts are lost)."""
    if gib is not None and gib <= 0:
        raise ValueError(f"workspace size must be positive GiB, got {gib}")
    _CONFIG.update(gib=gib, prefetch=prefetch)
    _DEFAULT.clear()
