"""The model runner: executes one scheduled step on the model.

`ContiguousRunner` is the first runner: it keeps one contiguous `KVCache` per request (the models'
reference cache) and runs each scheduled request's new tokens as one forward of batch 1. It is
correct for everything the scheduler does (chunked prefill appends to the cache; a preempted
request's cache is dropped and its tokens recomputed), but it neither batches requests into one
forward nor stores KV in the block pool's pages: the pool is the memory accounting of the step, not
its storage. Paged storage and ragged batched steps replace it (docs/engine.md); prefix caching
needs them, so it is off with this runner.
"""

from __future__ import annotations

import torch

from dayzero.engine.scheduler import SchedulerOutput
from dayzero.models import CausalLM, KVCache


class ContiguousRunner:
    def __init__(self, model: CausalLM):
        self.model = model
        self.device = model.device_
        self.caches: dict[str, KVCache] = {}

    @torch.no_grad()
    def execute(self, output: SchedulerOutput) -> dict[str, torch.Tensor]:
        """Run the step; returns float32 logits [vocab] of the last computed position of every
        request whose step reaches its last known token (the ones to sample for)."""
        for rid in output.preempted:
            self.caches.pop(rid, None)
        logits: dict[str, torch.Tensor] = {}
        for s in output.scheduled:
            req = s.request
            cache = self.caches.setdefault(req.request_id, self.model.new_cache(1))
            if cache.length != s.num_computed_tokens:
                raise RuntimeError(
                    f"request {req.request_id!r}: the scheduler resumes at token {s.num_computed_tokens} but its "
                    f"cache holds {cache.length}; this runner needs prefix caching off")
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            ids = torch.tensor([req.token_ids(start, end)], dtype=torch.long, device=self.device)
            positions = torch.arange(start, end, device=self.device)[None]
            out = self.model(ids, positions, cache)
            if s.samples:
                logits[req.request_id] = out[0, -1]
        return logits

    def free(self, request_id: str) -> None:
        self.caches.pop(request_id, None)
