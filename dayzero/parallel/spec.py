"""A rank's share of a model: the ModelSpec with each layer's attention heads split over the
tensor-parallel ranks, from which the rank's cache is planned (dayzero.cache.layout) and its attention
modules are sized.

Query heads split evenly (num_heads must divide). Key/value heads split with them when there are at
least as many as ranks; a single KV head (MLA's latent, MQA, DeepSeek-V4's shared key-value) is
replicated on every rank; anything else cannot be split and is an error naming the field.
"""

from __future__ import annotations

from dataclasses import replace

from dayzero.parallel.state import Parallel
from dayzero.spec import AttentionSpec, ModelSpec


def local_attention(a: AttentionSpec, p: Parallel, where: str) -> AttentionSpec:
    if p.tp_size == 1:
        return a
    start, stop = p.split(a.num_heads, f"{where}: num_attention_heads")
    kv = a.num_kv_heads
    if kv is not None and kv > 1:
        kv_start, kv_stop = p.split(kv, f"{where}: num_key_value_heads")
        kv = kv_stop - kv_start
    return replace(a, num_heads=stop - start, num_kv_heads=kv)


def local_spec(spec: ModelSpec, p: Parallel) -> ModelSpec:
    """spec as rank p holds it (spec itself at tensor-parallel size 1)."""
    if p.tp_size == 1:
        return spec
    layers = tuple(replace(layer, attention=local_attention(layer.attention, p, f"layer {layer.index}"))
                   for layer in spec.layers)
    return replace(spec, layers=layers)
