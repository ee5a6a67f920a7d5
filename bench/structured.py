"""The host and device cost of constrained decoding per step: llguidance filling the token masks of B
constrained rows (JSON schema, mid-value) and their application to the logits, against the
unconstrained step (no mask work at all) and, with --model, the engine's decode step at that batch.

    python bench/structured.py --tokenizer /tmp/gpt-oss-20b                       # masks only
    python bench/structured.py --tokenizer /tmp/gpt-oss-20b --device cuda --model /tmp/gpt-oss-20b

--tokenizer: a checkpoint directory with a tokenizer (bench/tokenizer.py writes a synthetic one of the
checkpoint's vocabulary into a random benchmark checkpoint); default the demo's (896 ids). Each row is
advanced by random valid tokens into the RECORDS_SCHEMA array before timing, so its masks are those
of a value in progress (inside strings, numbers, between keys). The end-to-end cost is `dayzero bench
--json-schema` against the same command without it.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

from dayzero.bench.workload import RECORDS_SCHEMA
from dayzero.structured.bitmask import TokenBitmask, apply_token_bitmask
from dayzero.structured.grammar import GrammarCompiler
from dayzero.structured.params import StructuredOutputs


def advanced_grammars(compiler: GrammarCompiler, rows: int, steps: int, seed: int):
    """rows matchers, each moved by `steps` random tokens its mask allows."""
    rng = random.Random(seed)
    bitmask = TokenBitmask(compiler.vocab_size, "cpu")
    grammars = [compiler.new(StructuredOutputs(json=RECORDS_SCHEMA)) for _ in range(rows)]
    for g in grammars:
        for _ in range(rng.randint(steps // 2, steps)):
            mask = bitmask.fill([g])[0]
            bits = ((mask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:compiler.vocab_size]
            allowed = bits.nonzero().flatten().tolist()
            g.accept(rng.choice(allowed))
    return grammars


def time_masks(compiler: GrammarCompiler, rows: int, device: str, iters: int) -> tuple[float, float]:
    """(median ms to fill the masks on the host and copy them, median ms to apply them) per step."""
    grammars = advanced_grammars(compiler, rows, 40, rows)
    bitmask = TokenBitmask(compiler.vocab_size, device)
    logits = torch.randn(rows, compiler.vocab_size, device=device)
    index = torch.arange(rows, device=device)
    fill, apply = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        masks = bitmask.fill(grammars)
        t1 = time.perf_counter()
        apply_token_bitmask(logits.clone(), index, masks)
        if device == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        fill.append(t1 - t0)
        apply.append(t2 - t1)
    return statistics.median(fill) * 1e3, statistics.median(apply) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", type=Path, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from dayzero.demo import demo_checkpoint
    from dayzero.model_path import read_json

    path = args.tokenizer or demo_checkpoint()
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = read_json(path / "config.json")
    eos = config.get("eos_token_id", tokenizer.eos_token_id)
    compiler = GrammarCompiler(tokenizer, config["vocab_size"], set(eos) if isinstance(eos, list) else {eos})
    t0 = time.perf_counter()
    compiler.ll_tokenizer
    print(f"vocab {config['vocab_size']}; llguidance tokenizer built in {time.perf_counter() - t0:.2f} s")
    print(f"{'rows':>5} {'fill + copy (ms)':>17} {'apply (ms)':>11} {'per row (us)':>13}   unconstrained: 0")
    for rows in args.rows:
        fill, apply = time_masks(compiler, rows, args.device, args.iters)
        print(f"{rows:>5} {fill:>17.3f} {apply:>11.3f} {(fill + apply) / rows * 1e3:>13.1f}")


if __name__ == "__main__":
    main()
