"""What every model file builds on: the CausalLM contract, weight targets, and the step cache.

Contract of a model (one file per family, registered by model_type in dayzero.models):
    model = Cls(spec, config, dtype=..., device=...)      # parameters allocated, not filled
    logits = model.forward_packed(input_ids [N], positions [N], cache)   # float32 [R, vocab]
The packed form is the engine's: the tokens of every scheduled sequence in one row, `cache` a
dayzero.cache.paged.PagedStepCache (`cache.seqs` says which rows belong to which sequence,
`cache.layers[i]` is layer i's view of the paged pool, `cache.logits_indices` the R rows whose
logits are returned, every row when None). A model writes each new cache entry once
(`view.append`) and hands the streams to attention ops, which read the pool in place; it does no
paging arithmetic and reads no device value back to the host.
The batched form, for tests and `dayzero verify`:
    logits = model(input_ids [B, T], positions [B, T], cache)   # float32 [B, T, vocab]
`cache` is None (one full forward, no state kept) or a `LocalCache` from `model.new_cache(batch)`:
then each call appends T tokens at positions cache.length ... cache.length + T - 1, so a prefill
followed by one-token decode steps computes what one full forward computes. It runs the packed
form on a paged cache of its own (dayzero.cache.local).

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

from dayzero.cache.local import LocalCache
from dayzero.parallel.spec import local_spec
from dayzero.parallel.state import current
from dayzero.spec import ModelSpec, resolve_config
from dayzero.weights import FLOAT_DTYPES, Layout, TensorSpec
from dayzero.weights.values import ValueCheck

RELEASE = Layout("release", "the names the model file documents")


@dataclass
class WeightTarget:
    """Where one checkpoint tensor goes: its expected shape/dtype and a function that stores it (it must
    copy: the loader reuses the tensor it passes). dest: set where storing is a copy of the stored bytes
    into this tensor (the same dtype, or packed bytes reinterpreted: int8 / uint8 / F8_E8M0); the loader
    then reads the file straight into it (dayzero.weights.fill) and assign is not called. shard: the loader
    reads only that slice of the stored tensor (dayzero/models/sharded.py)."""

    spec: TensorSpec
    assign: Callable[[torch.Tensor], None]
    dest: torch.Tensor | None = None
    shard: tuple[int, int, int] | None = None  # (dim, start, stop): only this slice of the stored tensor
    # (spec's shape) is read and handed to assign / copied into dest (a tensor-parallel rank's share)
    check: ValueCheck | None = None  # the values the stored tensor may not hold (dayzero/weights/values.py)


def empty_param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str | None = None) -> nn.Parameter:
    """An uninitialised, frozen parameter: it is filled from the checkpoint."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def copy_target(param: torch.Tensor, name: str, check: ValueCheck | None = None) -> WeightTarget:
    """Target that copies a checkpoint tensor into `param` as is (float weights are cast to the
    parameter's dtype; packed and quantized tensors must have exactly the parameter's dtype); check: what
    its values may not be (values.SCALES for a quantized weight's scales)."""
    is_float = param.dtype in FLOAT_DTYPES
    spec = TensorSpec(tuple(param.shape), FLOAT_DTYPES if is_float else param.dtype)

    def assign(tensor: torch.Tensor) -> None:
        with torch.no_grad():
            param.copy_(tensor)

    return WeightTarget(spec, assign, dest=param.detach(), check=check)


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
        self.parallel = current()  # this process's tensor-parallel rank (dayzero.parallel): its share of the heads
        self.check_parallel(spec.model_type, self.parallel.tp_size, self.parallel.ep_size)

    @classmethod
    def check_parallel(cls, model_type: str, tp: int, ep: int) -> None:
        """NotImplementedError naming the flag when the family cannot split as asked."""
        for size, able, what, flag in ((tp, cls.tensor_parallel, "tensor", "--tp"),
                                       (ep, cls.expert_parallel, "expert", "--ep")):
            if size > 1 and not able:
                raise NotImplementedError(f"{what} parallelism ({flag} {size}) is not built for {model_type} "
                                          f"yet; run it with {flag} 1")

    tensor_parallel: ClassVar[bool] = False  # the model's modules split over tensor-parallel ranks
    expert_parallel: ClassVar[bool] = False  # its routed experts split over expert-parallel ranks

    def cache_spec(self) -> ModelSpec:
        """The spec this rank's cache is planned from: its share of each layer's heads (dayzero.parallel.spec)."""
        return local_spec(self.spec, self.parallel)

    def new_cache(self, batch: int = 1, kv_cache_dtype: str = "auto"):
        return LocalCache(self, batch, kv_cache_dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache=None) -> torch.Tensor:
        """The batched form (module docstring); a 1-D input_ids is the packed form."""
        if input_ids.dim() == 1:
            return self.forward_packed(input_ids, positions, cache)
        self.check_inputs(input_ids, positions, cache, self.spec.vocab_size)
        b, t = input_ids.shape
        local = cache if cache is not None else self.new_cache(b)
        logits = self.forward_packed(input_ids.reshape(-1), positions.reshape(-1), local.step(t))
        return logits.view(b, t, -1)

    def forward_packed(self, input_ids: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not implement the packed forward")

    def cuda_graph_blocker(self, max_model_len: int) -> str | None:
        """Why a decode step of this model (sequences of up to max_model_len tokens) cannot be captured
        as a CUDA graph, or None when it can: its launches must depend on the batch size only, never on
        other host values such as the sequences' lengths (dayzero.engine.graphs). A family says so
        once its forward has been checked on the GPU."""
        return f"{type(self).__name__}'s forward has not been checked for CUDA-graph capture"

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
    def check_inputs(input_ids: torch.Tensor, positions: torch.Tensor, cache, vocab_size: int) -> None:
        if input_ids.dim() != 2 or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and positions must both be [batch, tokens]; got {tuple(input_ids.shape)} and {tuple(positions.shape)}"
            )
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab_size):
            raise ValueError(f"token ids must lie in [0, {vocab_size}); got min {int(input_ids.min())}, max {int(input_ids.max())}")
        if cache is not None and cache.batch != input_ids.shape[0]:
            raise ValueError(f"cache was made for batch {cache.batch}, input has batch {input_ids.shape[0]}")

