"""CUDA graphs for eager routed-expert calls at decode sizes: one graph per layer and token bucket.

Used by moe_experts_mxfp4 (path A), moe_experts_bf16 (path C) and moe_experts_fp8 (DeepSeek-V3-style FP8
experts): the layers without a host synchronisation.

An eager call of the MXFP4 layer at one token spends 280-500 µs in Python on the host (four kernel
launches, their argument handling, the checks and allocations) against 22-36 µs of GPU time in a graph
(BENCHMARKS.md, twelfth run; tools/profile_moe_host.py). The engine runs decode eagerly, so that host
time bounded its MoE decode. Here a call of up to DAYZERO_MOE_GRAPH_MAX_TOKENS tokens (default 32) on
CUDA replays a CUDA graph of the whole layer instead: the inputs are copied into the graph's static
buffers (one foreach copy; rows past the call's tokens padded with expert id E, which every dispatch
skips, refilled only where a larger call of the bucket left its ids), the graph replays, and the output
rows are copied out, so the result is a tensor of the caller's own. Host time per call 51-56 µs on the
H200's host (2026-12-02, from 59-104 with three copies, a fill per call and fresh views).

- Buckets: the token count rounded up to a power of two (1, 2, 4, ..., 32), so a layer holds at most six
  graphs; padded rows cost only their dispatch (no expert reads them).
- A key's first call runs eagerly (it compiles the kernels and computes the layer's scale facts, which
  need a host synchronisation); its second captures the graph (after a warm-up run on a side stream) and
  every later call replays it. The graphs of all layers share one memory pool per device.
- The graphs live on the layer's ExpertWeights object (they read its weights by address) and are dropped
  when any of its tensors is replaced or changed in place (data pointers and version counters), or when a
  setting that chooses kernels changes (the environment variables read at every call).
- Not used while a CUDA graph is being captured (the caller's graph then holds the kernels), under the
  interpreter, on other devices, with forced configs or MXFP4 path B (which synchronises with the host),
  or with DAYZERO_MOE_GRAPHS=0.

Exactness: a replay runs the same kernels on the same values as an eager call of the bucket's size;
tests/kernels/test_moe_graphs.py checks it against eager calls on the GPU, across buckets, layers and
in-place weight changes.
"""

from __future__ import annotations

import os

import torch

GRAPHS_ENV = "DAYZERO_MOE_GRAPHS"  # "0": eager calls stay eager
MAX_TOKENS_ENV = "DAYZERO_MOE_GRAPH_MAX_TOKENS"
DEFAULT_MAX_TOKENS = 32
# settings read by the kernel selection at every call: a change of any of them drops the graphs
_SELECTION_ENVS = ("DAYZERO_PDL", "DAYZERO_MOE_DECODE_GLUON", "DAYZERO_MOE_WGMMA", "DAYZERO_MOE_DECODE_SPLITK",
                   "DAYZERO_MOE_PATH")
_POOLS: dict[torch.device, tuple] = {}


def max_tokens() -> int:
    """The largest token count replayed from a graph (0: none)."""
    from dayzero.kernels.moe_mxfp4 import _tokens_setting

    if os.environ.get(GRAPHS_ENV, "1").strip() == "0":
        return 0
    return _tokens_setting(MAX_TOKENS_ENV, DEFAULT_MAX_TOKENS)


def bucket(tokens: int) -> int:
    """The graph size a call of `tokens` tokens replays: the next power of two."""
    return 1 << max(0, tokens - 1).bit_length()


def usable(x: torch.Tensor) -> bool:
    """Whether a call with activations x may replay a graph (module docstring)."""
    from dayzero.kernels.moe_gemm import interpreting

    return (x.is_cuda and not interpreting() and 0 < x.shape[0] <= max_tokens()
            and not torch.cuda.is_current_stream_capturing())


def _pool(device: torch.device):
    if device not in _POOLS:
        _POOLS[device] = torch.cuda.graph_pool_handle()
    return _POOLS[device]


def _state(experts) -> tuple:
    """What the graphs of `experts` depend on besides the call's shapes: its tensors' addresses and
    versions, and the kernel-selection settings."""
    tensors = [t for t in (experts.w13, experts.w2, experts.w13_scale, experts.w2_scale, experts.b13, experts.b2)
               if t is not None]
    return (tuple((t.data_ptr(), t._version) for t in tensors),
            tuple(os.environ.get(name) for name in _SELECTION_ENVS))


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
        side = torch.cuda.Stream(dev)
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


def graphed(run, x, topk_ids, topk_weights, experts, activation) -> torch.Tensor:
    """run(x, topk_ids, topk_weights), the layer's eager call, replayed from this layer's graph of the call's
    bucket, or run eagerly where no graph applies (usable() false, or the key's first call)."""
    if not usable(x):
        return run(x, topk_ids, topk_weights)
    state = _state(experts)
    cache = getattr(experts, "_dayzero_graphs", None)
    if cache is None or cache[0] != state:
        cache = (state, {})
        experts._dayzero_graphs = cache
    graphs = cache[1]
    size = bucket(x.shape[0])
    key = (size, x.shape[1], x.dtype, topk_ids.shape[1], topk_ids.dtype, topk_weights.dtype, activation, x.device)
    entry = graphs.get(key)
    if entry is None:  # the first call of this key runs eagerly; the next one captures
        graphs[key] = False
        return run(x, topk_ids, topk_weights)
    if entry is False:
        entry = graphs[key] = _Graph(run, x, topk_ids, topk_weights, experts.num_experts, size)
    return entry(x, topk_ids, topk_weights)
