"""Decode steps as CUDA graphs: captured once per batch-size bucket, replayed with padding.

A decode step (every scheduled sequence computes one token) of n sequences runs as the graph of the
smallest bucket b >= n (`graph_buckets`: 1, 2, 4, 8, then multiples of 8 up to max_num_seqs, as
vLLM captures): the runner writes the step's metadata into `StaticStep`'s fixed buffers (the first n
rows; the other b - n are padding sequences that touch only the storage's scratch page and slot) and
replays the graph, which leaves the logits of all b rows in its static output; rows :n are returned.
Steps with a prefill (or more sequences than the largest bucket) run eagerly.

Capture goes largest bucket first into one shared memory pool (a smaller graph reuses the larger
one's activation memory), after two eager warm-up runs per bucket (Triton compiles, lazy tables).
The host lengths a graph is captured with (max_model_len for every sequence) pick the kernels' split counts
and tiles; the kernels read the real lengths from the device buffers, so a replay is right for any
lengths (dayzero.kernels.attention.gqa_choose). The MoE layer's own per-layer graphs stand aside
while a whole-step graph is captured (dayzero.kernels.moe._graphs).

Which models can be captured: a model names what stops its decode step from being captured
(`CausalLM.cuda_graph_blocker`; every family now says none) and then runs
eagerly. Beyond that, capture itself decides: reference ops are the specification, not written for
capture (they check values on the host, loop over the sequences' host lengths, make data-dependent
shapes), so a capture during which an op ran its reference where it reads the sequences' host
lengths (`HOST_LENGTH_OPS`: a captured replay would read the capture's lengths, not the step's) or
which raised (a host synchronisation, a pageable copy) is abandoned, and decode runs eagerly
(`GraphCaptureError`; the engine logs the reason once). Kernels chosen on the GPU (bf16 MoE and
MLA, paged GQA, the per-token kernels) capture.

`DecodeGraphs(capture=False)` runs the same padded static step eagerly instead (on the CPU, where
there are no graphs; DAYZERO_STATIC_DECODE): the tests use it to check the padding and the fixed
buffers against the ordinary step.

In a tensor / expert-parallel job every rank captures the same buckets in the same order (the
collectives inside the forward are captured with them) and replays the bucket of each step rank 0
runs as a graph (`StepMessage.graph`). `agree` (dayzero.parallel.comm.first_error) makes a capture
that fails on one rank fail on all, after each bucket, so that no rank warms up the next bucket's
collectives alone.
"""

from __future__ import annotations

import logging
import time

import torch

from dayzero.cache.paged import PagedKVStorage, PagedStepCache
from dayzero.cache.static_step import StaticStep
from dayzero.cache.step import SeqStep
from dayzero.kernels.devices import warmup_stream
from dayzero.ops.registry import REFERENCE, REGISTRY

log = logging.getLogger("dayzero")

# Reference ops that loop over a step's sequences with the SeqBatch host lengths: captured, a replay
# would run the capture's lengths, whatever the step's are.
HOST_LENGTH_OPS = ("paged_gqa_attention", "paged_mla_attention", "paged_sparse_mla_attention", "paged_index_topk",
                   "paged_v4_attention", "paged_v4_index_topk")


class GraphCaptureError(RuntimeError):
    """The decode step cannot be captured; the message says which op or error stopped it."""


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture, ascending: 1, 2, 4, 8, 16, 24, ... and max_num_seqs itself."""
    if max_num_seqs < 1:
        raise ValueError(f"graph_buckets: max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


class DecodeGraphs:
    def __init__(self, model, storage: PagedKVStorage, block_size: int, max_num_seqs: int, max_model_len: int,
                 capture: bool = True, progress: bool = False, agree=None):
        if storage.scratch_pages is None:
            raise ValueError("DecodeGraphs needs a storage made with scratch=True (a page for the padding sequences)")
        self.model, self.storage = model, storage
        self.buckets = graph_buckets(max_num_seqs)
        self.static = StaticStep(storage.layout, block_size, max_num_seqs, max_model_len,
                                 storage.scratch_pages, storage.scratch_slot, model.device_)
        self.capture = capture
        self.agree = agree if agree is not None else (lambda error: error)  # every rank's outcome of a bucket
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0
        self.num_replays = 0
        if capture:
            self._capture_all(progress)

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def takes(self, steps: list[SeqStep]) -> bool:
        """Whether this step runs as a graph: 1 to max_batch sequences, each decoding one given token
        of a sequence that already has tokens (a fresh one would need its state zeroed)."""
        return 0 < len(steps) <= self.max_batch and all(
            s.num_new == 1 and s.start > 0 and s.token_ids is not None for s in steps)

    def run(self, steps: list[SeqStep], patch=None) -> torch.Tensor:
        """float32 logits [len(steps), vocab] of a step `takes` accepts, the sequences in their order.
        patch(input_ids): writes input tokens the host does not have yet (async scheduling)."""
        n = len(steps)
        b = self.bucket(n)
        self.static.fill(steps, b)
        if patch is not None:
            patch(self.static.dev["input_ids"])
        if not self.capture:  # the same padded step, eagerly, with the real host lengths
            lens = tuple(s.start + 1 for s in steps) + (1,) * (b - n)
            return self._forward(self.static.meta(b, lens))[:n]
        self.graphs[b].replay()
        self.num_replays += 1
        return self.outputs[b][:n]

    def _forward(self, meta) -> torch.Tensor:
        cache = PagedStepCache(self.storage, meta, self.model.spec.num_layers)
        return self.model.forward_packed(meta.input_ids, meta.positions, cache)

    @torch.no_grad()
    def _capture_all(self, progress: bool) -> None:
        from tqdm import tqdm

        start = time.perf_counter()
        device = self.model.device_
        pool = torch.cuda.graph_pool_handle()
        bar = tqdm(sorted(self.buckets, reverse=True), desc="capturing decode graphs", unit="graph",
                   disable=not progress)
        for b in bar:
            free, _ = torch.cuda.mem_get_info(device)
            bar.set_postfix_str(f"batch {b}, {free / 2**30:.1f} GiB free")
            self.static.fill([], b)
            meta = self.static.meta(b)
            side = warmup_stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(meta)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.current_stream(device)
            error, cause = None, None
            try:
                with REGISTRY.record_calls(by_backend=True) as calls, torch.cuda.graph(graph, pool=pool):
                    out = self._forward(meta)
            except Exception as e:  # an op that cannot run under capture: a host sync, a pageable copy
                torch.cuda.set_stream(stream)  # a failed capture_end leaves the capture stream current
                error, cause = f"capturing batch {b} failed: {type(e).__name__}: {str(e).splitlines()[0]}", e
            else:
                host = sorted(op for op in HOST_LENGTH_OPS if f"{op}@{REFERENCE}" in calls)
                if host:
                    error = (f"{', '.join(host)} ran the reference op, which loops over the sequences' host lengths "
                             "(no kernel takes these inputs: dtype or shapes)")
            error = self.agree(error)
            if error is not None:
                raise GraphCaptureError(error) from cause
            self.graphs[b], self.outputs[b] = graph, out
        torch.cuda.synchronize(device)
        self.capture_seconds = time.perf_counter() - start
        free, _ = torch.cuda.mem_get_info(device)
        log.info("captured %d decode graphs (batch %s) in %.1f s; %.1f GiB free", len(self.graphs),
                 ",".join(map(str, self.buckets)), self.capture_seconds, free / 2**30)
