"""CUDA graphs for eager routed-expert calls at decode sizes: one graph per layer and token bucket.

An eager call of the MXFP4 layer at one token spends 280-500 µs in Python on the host (four kernel
launches, their argument handling, the checks and allocations) against 22-36 µs of GPU time in a graph
(tools/profile_moe_host.py); the engine runs decode eagerly, so that host time would bound its MoE
decode. A call the chooser gives Plan.graph_tokens (choose.py: CUDA, compiled, not during a capture, up
to DAYZERO_MOE_GRAPH_MAX_TOKENS tokens, not path B, which synchronises with the host) replays a CUDA
graph of the whole layer instead: the inputs are copied into the graph's static buffers (one foreach
copy; rows past the call's tokens padded with expert id E, which every dispatch skips, refilled only
where a larger call of the bucket left its ids), the graph replays, and the output rows are copied out,
so the result is a tensor of the caller's own. Host time per call about 51-56 µs on the H200's host.

- Buckets: the token count rounded up to a power of two (1, 2, 4, ..., 32), so a layer holds at most six
  graphs; padded rows cost only their dispatch (no expert reads them). The plan is the bucket's.
- A key's first call runs eagerly (it compiles the kernels and computes the layer's scale facts, which
  need a host synchronisation); its second captures the graph (after a warm-up run on a side stream) and
  every later call replays it. The graphs of all layers share one memory pool per device.
- The graphs are state of the layer (_state.py: they read its weights by address) and are dropped when
  any of its tensors is replaced or changed in place (data pointers and version counters); the key holds
  the plan and the settings, so another kernel choice or setting captures anew.

Exactness: a replay runs the same kernels on the same values as an eager call of the bucket's plan;
tests/kernels/test_moe_graphs.py checks it against eager calls on the GPU, across buckets, layers and
in-place weight changes.
"""

from __future__ import annotations

import torch

from dayzero import settings
from dayzero.kernels.devices import warmup_stream
from dayzero.kernels.moe._state import layer_state, tensors_key

_POOLS: dict[torch.device, tuple] = {}


def _pool(device: torch.device):
    if device not in _POOLS:
        _POOLS[device] = torch.cuda.graph_pool_handle()
    return _POOLS[device]


class _Graph:
    """A captured layer of `size` tokens and its static buffers."""

    def __init__(self, run, x, topk_ids, topk_weights, num_experts: int, size: int):
        T, k = topk_ids.shape
        dev = x.device
        self.x = torch.zeros(size, x.shape[1], dtype=x.dtype, device=dev)
        self.ids = torch.full((size, k), num_experts, dtype=topk_ids.dtype, device=dev)
        self.weights = torch.zeros(size, k, dtype=topk_weights.dtype, device=dev)
        self.num_experts = num_experts
        self.rows = 0  # rows of ids from here on hold expert E (no expert)
        self.inputs: dict[int, list] = {}  # per token count: the views of the static inputs it fills
        self.outputs: dict[int, torch.Tensor] = {}  # ... and of the output it reads
        self._load(x, topk_ids, topk_weights)
        side = warmup_stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # compiles the bucket's kernels and settles the allocator
            run(self.x, self.ids, self.weights)
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=_pool(dev)):
            self.out = run(self.x, self.ids, self.weights)

    def _load(self, x, topk_ids, topk_weights) -> None:
        """The call's rows into the static inputs: one foreach copy (x, the ids and the weights have the
        buffers' dtypes: they are part of the graph's key), and expert E again in the rows a larger call
        of this bucket left behind."""
        T = x.shape[0]
        views = self.inputs.get(T)
        if views is None:
            views = self.inputs[T] = [self.x[:T], self.ids[:T], self.weights[:T]]
        torch._foreach_copy_(views, [x, topk_ids, topk_weights])
        if T < self.rows:
            self.ids[T:self.rows].fill_(self.num_experts)
        self.rows = T

    def __call__(self, x, topk_ids, topk_weights) -> torch.Tensor:
        self._load(x, topk_ids, topk_weights)
        self.graph.replay()
        T = x.shape[0]
        out = self.outputs.get(T)
        if out is None:
            out = self.outputs[T] = self.out[:T]
        return out.clone()


def replay(run, plan, x, topk_ids, topk_weights, experts, activation) -> torch.Tensor:
    """run(x, topk_ids, topk_weights), the layer's eager call of `plan`, replayed from this layer's graph of
    plan.graph_tokens rows (or run eagerly: the key's first call)."""
    state = layer_state(experts)
    tensors = tensors_key(experts)
    cache = state.get("graphs")
    if cache is None or cache[0] != tensors:
        cache = state["graphs"] = (tensors, {})
    graphs = cache[1]
    key = (plan, x.shape[1], x.dtype, topk_ids.shape[1], topk_ids.dtype, topk_weights.dtype, activation, x.device,
           settings.get())
    entry = graphs.get(key)
    if entry is None:  # the first call of this key runs eagerly; the next one captures
        graphs[key] = False
        return run(x, topk_ids, topk_weights)
    if entry is False:
        entry = graphs[key] = _Graph(run, x, topk_ids, topk_weights, experts.num_experts, plan.graph_tokens)
    return entry(x, topk_ids, topk_weights)
