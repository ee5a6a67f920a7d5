"""The transformers baseline of `dayzero bench --vs transformers`: the same requests through
transformers' `generate` in the same process, greedy, on the same device and dtype.

transformers batches statically: the requests go in order in batches of max_concurrency (all at once
when unset), each batch left-padded to its longest prompt and generating until its longest output
(with ignore_eos, min_new_tokens keeps every row going). Only the tokens each request asked for count
(its output length, or up to its first EOS without ignore_eos), so a batch's padding and overrun are
the baseline's cost, not its output. The model is transformers' as installed (no DSA tie rule:
`load_reference(ties="torch")`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dayzero.bench.workload import BenchRequest

PAD_TOKEN_ID = 0  # masked out: any id does


@dataclass
class BaselineResult:
    max_concurrency: int | None
    batch_size: int
    completed: int
    total_output_tokens: int
    duration: float

    def summary(self) -> dict:
        return {"backend": "transformers", "max_concurrency": self.max_concurrency, "batch_size": self.batch_size,
                "completed": self.completed, "duration": self.duration,
                "total_output_tokens": self.total_output_tokens,
                "output_throughput": self.total_output_tokens / self.duration}


def load_baseline(path: Path, dtype: torch.dtype, device: str) -> torch.nn.Module:
    from dayzero.verify import load_reference

    return load_reference(path, dtype, device, ties="torch")


def _batch(requests: list[BenchRequest], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and their attention mask, [B, longest prompt]."""
    width = max(len(r.prompt_token_ids) for r in requests)
    ids = torch.full((len(requests), width), PAD_TOKEN_ID, dtype=torch.long)
    mask = torch.zeros((len(requests), width), dtype=torch.long)
    for row, r in enumerate(requests):
        n = len(r.prompt_token_ids)
        ids[row, width - n:] = torch.tensor(r.prompt_token_ids)
        mask[row, width - n:] = 1
    return ids.to(device), mask.to(device)


def _generate(model, requests: list[BenchRequest], ignore_eos: bool, max_new_tokens: int | None = None) -> torch.Tensor:
    ids, mask = _batch(requests, next(model.parameters()).device)
    new = max_new_tokens or max(r.output_len for r in requests)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new if ignore_eos else 0,
                             do_sample=False, pad_token_id=PAD_TOKEN_ID)
    return out[:, ids.shape[1]:]


def counted_tokens(row: list[int], output_len: int, ignore_eos: bool, eos_token_ids: set[int]) -> int:
    """The tokens of one generated row that the request asked for."""
    row = row[:output_len]
    if not ignore_eos:
        end = next((k for k, t in enumerate(row) if t in eos_token_ids), None)
        if end is not None:
            row = row[:end + 1]
    return len(row)


def run_transformers(model, requests: list[BenchRequest], max_concurrency: int | None, ignore_eos: bool = True,
                     eos_token_ids: set[int] = frozenset(), progress=None) -> BaselineResult:
    """Time the requests through model.generate in batches of max_concurrency, after one short
    warm-up batch (first calls allocate and compile)."""
    batch = len(requests) if max_concurrency is None else min(max_concurrency, len(requests))
    device = next(model.parameters()).device
    _generate(model, requests[:batch], ignore_eos, max_new_tokens=2)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    tokens = 0
    for first in range(0, len(requests), batch):
        chunk = requests[first:first + batch]
        generated = _generate(model, chunk, ignore_eos).tolist()
        tokens += sum(counted_tokens(row, r.output_len, ignore_eos, eos_token_ids) for row, r in zip(generated, chunk))
        if progress is not None:
            progress.update(len(chunk))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return BaselineResult(max_concurrency, batch, len(requests), tokens, time.perf_counter() - start)
