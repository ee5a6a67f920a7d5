"""What every model file builds on: the CausalLM contract, weight targets, and the step cache.

Contract of a model (one file per family, registered by model_type in dayzero.models):
    model = Cls(spec, config, dtype=..., device=...)      # parameters allocated, not filled
    logits = model(input_ids [B, T], positions [B, T], cache)   # float32 [B, T, vocab]
`cache` is None (one full forward, no state kept) or a `KVCache` from `model.new_cache(batch)`:
then each call appends T tokens at positions cache.length ... cache.length + T - 1, so a prefill
followed by one-token decode steps computes what one full forward computes.

Weights are loaded by name. By default a module's parameters are filled from the checkpoint tensor
of the same dotted name, so a model file mirrors the release checkpoint's names. A module whose
memory layout differs from the checkpoint's (stacked experts, renamed tensors) overrides
`weight_targets(prefix)` and maps each checkpoint name to a `WeightTarget`. Checkpoints stored
under other names (what transformers writes) are mapped onto these by the model's `layouts()`
(dayzero.weights.layouts), chosen from the tensor names at load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import torch
from torch import nn

from dayzero.spec import ModelSpec, resolve_config
from dayzero.weights import FLOAT_DTYPES, Layout, TensorSpec

RELEASE = Layout("release", "the names the model file documents")


@dataclass
class WeightTarget:
    """Where one checkpoint tensor goes: its expected shape/dtype and a function that stores it."""

    spec: TensorSpec
    assign: Callable[[torch.Tensor], None]


def empty_param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str | None = None) -> nn.Parameter:
    """An uninitialised, frozen parameter: it is filled from the checkpoint."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def copy_target(param: torch.Tensor, name: str) -> WeightTarget:
    """Target that copies a checkpoint tensor into `param` as is (float weights are cast to the
    parameter's dtype; packed and quantized tensors must have exactly the parameter's dtype)."""
    is_float = param.dtype in FLOAT_DTYPES
    spec = TensorSpec(tuple(param.shape), FLOAT_DTYPES if is_float else param.dtype)

    def assign(tensor: torch.Tensor) -> None:
        with torch.no_grad():
            param.copy_(tensor)

    return WeightTarget(spec, assign)


def collect_weight_targets(module: nn.Module, prefix: str = "") -> dict[str, WeightTarget]:
    """Checkpoint name -> target for every parameter and persistent buffer under `module` (named
    prefix + its dotted name), using a submodule's own `weight_targets(prefix)` where it has one."""
    targets: dict[str, WeightTarget] = {}
    for name, param in module.named_parameters(recurse=False):
        targets[prefix + name] = copy_target(param, prefix + name)
    for name, buf in module.named_buffers(recurse=False):
        if name not in module._non_persistent_buffers_set:
            targets[prefix + name] = copy_target(buf, prefix + name)
    for name, child in module.named_children():
        custom = getattr(child, "weight_targets", None)
        child_prefix = f"{prefix}{name}."
        targets.update(custom(child_prefix) if custom is not None else collect_weight_targets(child, child_prefix))
    return targets


class KVCache:
    """The per-sequence state of a reference forward: `layers[i]` is a dict that layer i's attention
    fills as it needs (keys, values, latents, indexer keys, compressor state); `length` counts the
    tokens already processed. All B sequences of a batch advance together."""

    def __init__(self, num_layers: int, batch: int):
        self.layers: list[dict[str, torch.Tensor]] = [{} for _ in range(num_layers)]
        self.batch = batch
        self.length = 0


def cache_append(layer_cache, name: str, new: torch.Tensor, window: int | None = None, rate: int = 1,
                 read: bool = True) -> torch.Tensor | None:
    """Append this step's entries [B, T, ...] to the layer's stream `name` and return the entries
    attention reads [B, S, ...] (the last T are the new ones); without a cache (one full forward)
    just the new ones. `window` W marks a sliding-window stream: only the last W - 1 entries before
    the new ones must be kept (older ones may still be returned; attention masks them). `rate` r > 1
    marks a stream of one entry per r tokens (compressed entries): a step that computes tokens
    [start, end) appends exactly the entries end // r - start // r.

    `layer_cache` is a dict (the reference cache, one contiguous tensor per stream) or a paged view
    (dayzero.cache.paged), which stores entries in the block pool's pages and returns every row of a
    batch right-aligned, padded on the left; `cache_lens` then gives each row's real length. With
    read=False a paged cache only writes (returns None): read the entries needed with `cache_select`."""
    if layer_cache is None:
        return new
    if not isinstance(layer_cache, dict):
        return layer_cache.append(name, new, window, rate, read)
    full = new if name not in layer_cache else torch.cat([layer_cache[name], new], dim=1)
    keep = full.shape[1] if window is None else min(full.shape[1], window - 1)
    layer_cache[name] = full[:, full.shape[1] - keep:]
    return full


def cache_select(layer_cache, name: str, entries: torch.Tensor | None, indices: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The entries at per-query indices [B, T, K] (into what cache_append returns; -1 = none) as a
    compact [B, T*K, ...] tensor, and the indices into it ([B, T, K], -1 kept). A paged cache reads
    only these entries through its page table (decode of sparse attention); otherwise they are
    taken from `entries`, what cache_append returned."""
    b, t, k = indices.shape
    flat = indices.reshape(b, t * k).clamp(min=0)
    if layer_cache is not None and not isinstance(layer_cache, dict):
        picked = layer_cache.select(name, flat)
    else:
        picked = torch.gather(entries, 1, flat.view(b, t * k, *[1] * (entries.dim() - 2)).expand(-1, -1, *entries.shape[2:]))
    local = torch.arange(t * k, device=indices.device).view(1, t, k).expand(b, t, k)
    return picked, local.masked_fill(indices < 0, -1)


def cache_lens(layer_cache, name: str) -> torch.Tensor | None:
    """int [B]: how many of the entries `cache_append` returned for `name` are real in each row
    (right-aligned), or None when no row is padded. Attention ops take it as `kv_lens`."""
    if layer_cache is None or isinstance(layer_cache, dict):
        return None
    return layer_cache.lens(name)


class CausalLM(nn.Module):
    """Base of every model file. Subclasses set `model_types` and implement `forward`."""

    model_types: ClassVar[tuple[str, ...]] = ()
    # Checkpoint tensors the model does not use and the loader skips (regexes, re.search), e.g. MTP layers.
    ignore_unexpected: ClassVar[tuple[str, ...]] = ()

    def __init__(self, spec: ModelSpec, config: dict, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.spec = spec
        self.config = resolve_config(config)  # the reference's defaults filled in (dayzero.spec.DEFAULTS)
        self.dtype = dtype
        self.device_ = torch.device(device)

    def new_cache(self, batch: int = 1) -> KVCache:
        return KVCache(self.spec.num_layers, batch)

    def weight_targets(self, prefix: str = "") -> dict[str, WeightTarget]:
        return collect_weight_targets(self, prefix)

    def ignore_patterns(self) -> tuple[str, ...]:
        """Regexes of checkpoint tensors to skip; a model may compute them from its config."""
        return self.ignore_unexpected

    def layouts(self) -> tuple[Layout, ...]:
        """The tensor layouts this model loads, tried in order: the release first."""
        return (RELEASE,)

    def post_load(self) -> None:
        """Called once every weight is in place (precompute derived tensors here)."""

    @staticmethod
    def check_inputs(input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache | None, vocab_size: int) -> None:
        if input_ids.dim() != 2 or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and positions must both be [batch, tokens]; got {tuple(input_ids.shape)} and {tuple(positions.shape)}"
            )
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab_size):
            raise ValueError(f"token ids must lie in [0, {vocab_size}); got min {int(input_ids.min())}, max {int(input_ids.max())}")
        if cache is not None and cache.batch != input_ids.shape[0]:
            raise ValueError(f"cache was made for batch {cache.batch}, input has batch {input_ids.shape[0]}")

