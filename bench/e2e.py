"""End to end on one GPU: dayzero vs transformers' `generate` vs the roofline, in one run.

    python bench/e2e.py --model /tmp/gpt-oss-20b --make          # writes the random checkpoint first if absent
    python bench/e2e.py --model /tmp/gpt-oss-20b --quick --no-transformers
    python bench/e2e.py --model /tmp/dsv32 --make deepseek-v3.2 --no-transformers --modes async \
        --ttft 8192 32768 131072 --long-decode 16                 # DeepSeek-V3.2 shapes at long context

Measures (greedy, random prompt token ids, `ignore_eos`, prefix caching off, every shape run once
before it is timed so that kernels are compiled and layer graphs captured):
  decode step at batch 1 and 64 (128-token prompts): the median wall time of one engine step
      (schedule, one packed forward, sampling, the one device-to-host copy of the ids);
      transformers: (generate(n2) - generate(n1)) / (n2 - n1) on the same prompts;
  prefill of 64 x 128-token prompts: from adding the requests to every first token;
      transformers: generate(max_new_tokens=1) over the [64, 128] batch;
  TTFT of one long prompt (4K / 16K / 32K, chunked by max_num_batched_tokens; after a warm-up prompt of
      the same length, at most 4 chunks), and with --long-decode N the median of its next N decode steps
      (batch 1 at that context).
Roofline (gpt-oss: `Shapes`; other families: `SpecShapes`, from dayzero's spec), measured in the same run: copy bandwidth (a 2 GiB device-to-device copy: bytes read +
written / time) and the bf16 matmul rate (8192^3 on random data). A decode step reads every
non-expert weight, lm_head, the experts its tokens route to (expected distinct experts of B tokens
picking top-k of E uniformly) and the KV cache; a prefill does 2 x active parameters FLOPs per token
plus causal attention.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.moe import copy_bandwidth, matmul_rate  # noqa: E402  (the roofline's two ceilings, measured now)


class Shapes:
    """Bytes and FLOPs of a gpt-oss-style MoE model from its config."""

    def __init__(self, config: dict):
        c = config
        self.layers, h = c["num_hidden_layers"], c["hidden_size"]
        heads, kv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.e, self.k, inter, vocab = c["num_local_experts"], c["num_experts_per_tok"], c["intermediate_size"], c["vocab_size"]
        self.heads, self.d, self.kv = heads, d, kv
        attn = h * (heads + 2 * kv) * d + heads * d * h
        self.dense_params = self.layers * (attn + h * self.e) + vocab * h  # + lm_head; embeddings read by row
        self.expert_params = 3 * h * inter  # one expert: gate, up, down
        self.expert_bytes = self.expert_params * (0.5 + 1 / 32)  # MXFP4: 4 bits + one E8M0 byte per 32
        self.kv_bytes_per_token = {w: self.layers // 2 * 2 * kv * d * 2 for w in ("full", "window")}
        self.window = c.get("sliding_window") or 0

    def decode_bytes(self, batch: int, context: int) -> float:
        distinct = self.e * (1 - (1 - self.k / self.e) ** batch)
        kv = self.kv_bytes_per_token["full"] * context + self.kv_bytes_per_token["window"] * min(context, self.window)
        return 2 * self.dense_params + self.layers * distinct * self.expert_bytes + batch * kv

    def prefill_flops(self, tokens_per_seq: int, seqs: int) -> float:
        active = self.dense_params + self.layers * self.k * self.expert_params
        t = tokens_per_seq
        attn = self.layers // 2 * (4 * self.heads * self.d * t * t / 2 + 4 * self.heads * self.d * t * min(t, self.window))
        return seqs * (2 * active * t + attn)


class SpecShapes:
    """Bytes and FLOPs of any family from dayzero's spec of the checkpoint (dayzero.plan): every
    non-embedding weight in its stored format (the tied table counted as lm_head), each MoE layer's
    expected distinct routed experts of the batch, the KV cache entries of the context (a window's or a
    compressor's bounded part once per sequence; DSA: every index key, the top-k latents); prefill: 2 x active parameters per token (attention
    scores not counted: under 1% at 128 tokens)."""

    def __init__(self, path: Path):
        from dayzero import plan
        from dayzero.spec import load_spec

        spec = self.spec = load_spec(path)
        q = spec.quant

        def bpp(category: str) -> float:
            fmt = plan._category_format(spec, category)
            group = q.group_size if fmt in ("mxfp4", "int4") else None
            return plan.bytes_per_param(fmt, fp8_block=q.fp8_block, scale_fmt=q.scale_fmt, group_size=group)

        counts = plan.param_counts(spec)
        skip = ("embedding", "routed_experts", "vision")
        self.dense_bytes = sum(n * bpp(c) for c, n in counts.items() if c not in skip)
        if spec.tie_word_embeddings:
            self.dense_bytes += counts["embedding"] * bpp("lm_head")
        self.moe = [layer.mlp.experts for layer in spec.layers if layer.mlp.experts is not None]
        self.expert_bytes = [plan.expert_params(e) * bpp("routed_experts") for e in self.moe]
        self.active = plan.active_params(spec)
        self.caches = [(plan.layer_cache(layer.attention), layer.attention.index_topk if layer.attention.kind == "dsa"
                        else None) for layer in spec.layers]

    def decode_bytes(self, batch: int, context: int) -> float:
        experts = sum(e.num * (1 - (1 - e.top_k / e.num) ** batch) * b for e, b in zip(self.moe, self.expert_bytes))
        kv = 0.0
        for c, topk in self.caches:
            kv += c.per_token * context + c.fixed
            if topk is not None and context > topk:  # DSA reads every index key, but only top-k latents
                kv -= (c.detail["kv_latent"] + c.detail["k_pe"]) * (context - topk)
        return self.dense_bytes + experts + batch * kv

    def prefill_flops(self, tokens_per_seq: int, seqs: int) -> float:
        return 2 * self.active * tokens_per_seq * seqs


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n, length), generator=g).tolist()


def dayzero_numbers(path: Path, args, vocab: int, mode: str, ttft: list[int]) -> dict:
    from dayzero import LLM, SamplingParams

    longest = max(ttft, default=0)
    t0 = time.perf_counter()
    llm = LLM(path, device="cuda", dtype="bfloat16", max_num_seqs=64, max_num_batched_tokens=args.budget,
              max_model_len=max(longest, 128) + 64 + args.long_decode, kv_cache_gib=args.kv_gib, enable_prefix_caching=False,
              cuda_graphs=mode != "eager", async_scheduling=mode == "async")
    engine = llm.engine
    out: dict = {"start_s": time.perf_counter() - t0}
    if llm.runner.graphs is not None:
        out["capture_s"] = llm.runner.graphs.capture_seconds

    def run(prompts, max_tokens):
        """Add the requests; (seconds until every request has its first token, [decode step seconds])."""
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        ids = []
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i, p in enumerate(prompts):
            rid = f"r{time.monotonic_ns()}-{i}"
            engine.add_request(rid, *engine.validate(p, params))
            ids.append(rid)
        firsts: set[str] = set()
        while len(firsts) < len(ids):
            for u in engine.step():
                if u.new_token_ids:
                    firsts.add(u.request_id)
        prefill = time.perf_counter() - start
        steps = []
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
        for rid in ids:
            engine.pop_finished(rid)
        return prefill, steps

    for batch in () if args.long_only else (1, 64):
        prompts = _prompts(batch, 128, vocab, seed=batch)
        run(prompts, 4)  # warm-up: compile kernels, capture the MoE graphs of these token counts
        prefill, steps = run(prompts, args.steps + 1)
        out[f"decode_b{batch}"] = statistics.median(steps)
        out[f"prefill_{batch}x128"] = prefill
        print(f"  {mode}: decode_b{batch} {out[f'decode_b{batch}'] * 1e3:.2f} ms, prefill {prefill:.3f} s", flush=True)
    for length in ttft:
        # warm-up (kernels compiled for every chunk shape): the same length up to 4 chunks, 4 chunks above
        # (a 1M prompt's prefill takes minutes: its warm-up would double the run for nothing new)
        run(_prompts(1, min(length, 4 * args.budget), vocab, seed=7), 1)
        out[f"ttft_{length}"], steps = run(_prompts(1, length, vocab, seed=length), 1 + args.long_decode)
        if steps:
            out[f"decode_at_{length}"] = statistics.median(steps)
        print(f"  {mode}: ttft_{length} {out[f'ttft_{length}']:.3f} s" + (  # as it goes: a run cut short keeps these
            f", decode_at_{length} {out[f'decode_at_{length}'] * 1e3:.2f} ms" if steps else ""), flush=True)
    tokens = _prompts(1, 128, vocab, seed=1)[0]
    out["greedy_tokens"] = llm.generate([tokens], SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids
    out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    del llm, engine
    torch.cuda.empty_cache()
    return out


def transformers_numbers(path: Path, args, vocab: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda")
    out: dict = {}

    def generate(ids, n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            res = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t0, res

    n1, n2 = 4, 4 + args.steps
    for batch in (1, 64):
        ids = torch.tensor(_prompts(batch, 128, vocab, seed=batch), device="cuda")
        generate(ids, 2)  # warm-up
        t1, _ = generate(ids, n1)
        t2, _ = generate(ids, n2)
        out[f"decode_b{batch}"] = (t2 - t1) / (n2 - n1)
        out[f"prefill_{batch}x128"] = generate(ids, 1)[0]
    ids = torch.tensor(_prompts(1, 128, vocab, seed=1), device="cuda")
    out["greedy_tokens"] = generate(ids, 16)[1][0, 128:].tolist()
    del model
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--make", nargs="?", const="gpt-oss-20b", metavar="KIND",
                    help="write the random checkpoint KIND (bench/checkpoints.py; default gpt-oss-20b) there if absent")
    ap.add_argument("--quick", action="store_true", help="fewer decode steps, TTFT at 4K unless --ttft says")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--ttft", type=int, nargs="*", default=None, help="prompt lengths (default 4K 16K 32K; --quick: 4K)")
    ap.add_argument("--long-decode", type=int, default=0, metavar="N",
                    help="after each TTFT prompt, time N decode steps at that context (batch 1)")
    ap.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens (the prefill chunk)")
    ap.add_argument("--long-only", action="store_true",
                    help="only the --ttft prompts (and --long-decode): no batch 1 / 64 decode and prefill rows")
    ap.add_argument("--kv-gib", type=float, default=16.0)
    ap.add_argument("--modes", nargs="+", choices=["graphs", "eager", "async"], default=["graphs", "eager"],
                    help="dayzero with decode CUDA graphs, eagerly, or with graphs and async scheduling "
                    "(TTFT: the first mode only)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.quick:
        args.steps = 8
    if args.ttft is None:
        args.ttft = [4096] if args.quick else [4096, 16384, 32768]
    if args.make and not (args.model / "config.json").exists():
        from bench.checkpoints import write_checkpoint

        t0 = time.perf_counter()
        write_checkpoint(args.make, args.model, "cuda")
        print(f"wrote {args.model} in {time.perf_counter() - t0:.0f} s", flush=True)
    config = json.loads((args.model / "config.json").read_text())
    shapes = Shapes(config) if config.get("model_type") == "gpt_oss" else SpecShapes(args.model)
    copy, flops = copy_bandwidth(), matmul_rate()
    torch.cuda.empty_cache()
    print(f"ceilings: copy {copy / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s", flush=True)
    runs = {}
    for i, mode in enumerate(args.modes):
        runs[mode] = dayzero_numbers(args.model, args, config["vocab_size"], mode, args.ttft if i == 0 else [])
        print(f"dayzero ({mode}): {runs[mode]}", flush=True)
    ours = runs[args.modes[0]]
    theirs = {} if args.no_transformers else transformers_numbers(args.model, args, config["vocab_size"])
    if theirs:
        print(f"transformers: {theirs}", flush=True)
    roof = {"decode_b1": shapes.decode_bytes(1, 140) / copy, "decode_b64": shapes.decode_bytes(64, 140) / copy,
            "prefill_64x128": shapes.prefill_flops(128, 64) / flops, "prefill_1x128": shapes.prefill_flops(128, 1) / flops}
    for length in args.ttft:
        roof[f"ttft_{length}"] = shapes.prefill_flops(length, 1) / flops
        roof[f"decode_at_{length}"] = shapes.decode_bytes(1, length) / copy
    rows = [k for k in ("decode_b1", "decode_b64", "prefill_1x128", "prefill_64x128") if k in ours]
    rows += [f"ttft_{n}" for n in args.ttft] + [f"decode_at_{n}" for n in args.ttft if f"decode_at_{n}" in ours]
    print(f"\n{'what':16} {'mode':7} {'dayzero':>10} {'transformers':>13} {'roofline':>10} {'roof/ours':>10} {'hf/ours':>8}")
    for k in rows:
        hf = theirs.get(k)
        for mode, r in runs.items():
            if k not in r:
                continue
            print(f"{k:16} {mode:7} {r[k] * 1e3:9.2f}ms {'' if hf is None else f'{hf * 1e3:11.2f}ms':>13} "
                  f"{roof[k] * 1e3:8.2f}ms {roof[k] / r[k]:10.2f} {'' if hf is None else f'{hf / r[k]:8.1f}'}")
    for mode, r in runs.items():
        print(f"dayzero ({mode}) engine start {r['start_s']:.1f} s" +
              (f", graph capture {r['capture_s']:.1f} s" if "capture_s" in r else ""))
    if theirs:
        same = sum(a == b for a, b in zip(ours["greedy_tokens"], theirs["greedy_tokens"]))
        print(f"greedy tokens agreeing with transformers (bf16, first 16): {same}/16")
    if len(runs) == 2:
        a, b = runs.values()
        same = sum(x == y for x, y in zip(a["greedy_tokens"], b["greedy_tokens"]))
        print(f"greedy tokens agreeing between {' and '.join(runs)} (first 16): {same}/16")
    print(f"dayzero peak GPU memory {ours['peak_gib']:.1f} GiB")
    if args.json:
        args.json.write_text(json.dumps({"dayzero": runs, "transformers": theirs, "roofline_s": roof,
                                         "copy_Bps": copy, "bf16_flops": flops}, indent=1))


if __name__ == "__main__":
    main()
