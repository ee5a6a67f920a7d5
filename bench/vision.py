"""Kimi K2.5's vision path on one GPU: dayzero vs transformers vs the roofline, in one run.

    python bench/vision.py --model /tmp/kimi-k25 --make        # writes bench/checkpoints.py kimi-k2.5 there if absent
    python bench/vision.py --model /tmp/kimi-k25 --quick --no-transformers

The checkpoint (bench/checkpoints.py kimi-k2.5, random weights): MoonViT and its projector at K2.5's size
over Kimi-K2's text model cut to 2 layers (1 dense, 1 MoE of 384 FP8 experts), bf16. Images: random
1024 x 1024 RGB, which the processor pads to 1036 x 1036 pixels, 74 x 74 = 5476 patches, 1369 placeholder
tokens (no resize: under 16384 patches).
  preprocess   Pillow preprocessing on the host (dayzero.multimodal.processor), images/s
  encoder      model.encode_images over B images at once (B = 1, 4, 16: one varlen attention over all),
               images/s, median of --runs after a warm-up; transformers: get_image_features on the same
               pixels (its default attention, SDPA per image)
  ttft         LLM.generate of one prompt (16 text tokens, one image, 16 text tokens) with max_tokens=1:
               request in to first token, preprocessing and the encoder included, a fresh image each run
               (the feature cache never hits), prefix caching off; transformers: generate(max_new_tokens=1)
               from the preprocessed pixel_values (its preprocessing not counted)
Roofline, from the bf16 matmul rate measured in the same run: the encoder's FLOPs (patch embedding, per
block the qkv / output / MLP projections and attention's two products over each image's patches, the
projector); TTFT adds 2 x the text model's active parameters per prompt token.
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

from bench.e2e import SpecShapes  # noqa: E402
from bench.moe import copy_bandwidth, matmul_rate  # noqa: E402

SIDE = 1024  # image width and height, pixels


def encoder_flops(spec, grids) -> float:
    """FLOPs of MoonViT + projector over images of these patch grids (t, h, w)."""
    v = spec.vision
    d, inter, p, kh, kw = v.hidden_size, v.intermediate_size, v.patch_size, *v.merge_kernel
    total = 0.0
    for t, h, w in grids:
        n = t * h * w
        total += 2 * n * 3 * p * p * d  # patch embedding
        total += v.num_layers * (2 * n * (3 * d * d + d * d + 2 * d * inter) + 4 * n * n * d)
        merged = (h // kh) * (w // kw)
        total += 2 * merged * ((kh * kw * d) ** 2 + kh * kw * d * v.text_hidden_size)
    return total


def images(n: int, seed: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)) for _ in range(n)]


def timed(fn, runs: int) -> float:
    """Median seconds of fn() over `runs` after one warm-up call, the GPU synchronised around each."""
    fn()
    out = []
    for _ in range(runs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def dayzero_numbers(path: Path, args) -> tuple[dict, object]:
    from dayzero import LLM, SamplingParams

    llm = LLM(path, device="cuda", dtype="bfloat16", max_num_batched_tokens=8192, kv_cache_gib=4.0,
              enable_prefix_caching=False, max_num_seqs=16)
    processor, model = llm.engine.image_processor, llm.model
    out: dict = {}
    pictures = images(max(args.batches), seed=0)
    t0 = time.perf_counter()
    processed = [processor.preprocess(im) for im in pictures]
    out["preprocess_images_per_s"] = len(pictures) / (time.perf_counter() - t0)
    out["grid"] = list(processed[0].grid)
    out["tokens_per_image"] = processed[0].num_tokens
    with torch.no_grad():
        for b in args.batches:
            pixels = torch.cat([im.pixels for im in processed[:b]]).to("cuda", torch.bfloat16)
            grids = tuple(im.grid for im in processed[:b])
            out[f"encoder_b{b}_s"] = timed(lambda: model.encode_images(pixels, grids), args.runs)
    fresh = iter(images(args.runs + 1, seed=1))
    text = list(range(1000, 1016))
    prompt = text + [model.image_token_id] + text
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    encoded = llm.engine.feature_cache.num_encoded
    out["ttft_s"] = timed(lambda: llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": next(fresh)}},
                                               params), args.runs)
    assert llm.engine.feature_cache.num_encoded == encoded + args.runs + 1  # every run encoded its own image
    out["ttft_prompt_tokens"] = len(prompt) - 1 + processed[0].num_tokens
    out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out, (llm, processed)


def transformers_numbers(path: Path, args, processed) -> dict:
    from dayzero.verify import load_reference

    model = load_reference(path, torch.bfloat16, "cuda", dequantize=True)  # FP8 text weights as bf16 (verify.py)
    out: dict = {}
    with torch.no_grad():
        for b in args.batches:
            pixels = torch.cat([im.pixels for im in processed[:b]]).to("cuda", torch.bfloat16)
            grid = torch.tensor([list(im.grid) for im in processed[:b]], device="cuda")
            out[f"encoder_b{b}_s"] = timed(lambda: model.model.get_image_features(pixels, grid), args.runs)
        image = processed[0]
        ids = torch.tensor([list(range(1000, 1016)) + [model.config.image_token_id] * image.num_tokens
                            + list(range(1000, 1016))], device="cuda")
        pixels = image.pixels.to("cuda", torch.bfloat16)
        grid = torch.tensor([list(image.grid)], device="cuda")
        out["ttft_s"] = timed(lambda: model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels,
                                                     image_grid_thw=grid, max_new_tokens=1, do_sample=False,
                                                     pad_token_id=0), args.runs)
    return out  # the model is freed with this frame


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--make", action="store_true", help="write bench/checkpoints.py kimi-k2.5 there if absent")
    ap.add_argument("--quick", action="store_true", help="batches 1 and 4, 3 runs")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--layers", type=int, default=2, help="--make: text layers (1: the dense layer alone, 2: + one "
                                                           "MoE layer of 384 FP8 experts, ~21.6 GiB)")
    args = ap.parse_args()
    if args.quick:
        args.runs, args.batches = 3, [1, 4]
    if args.make and not (args.model / "config.json").exists():
        from bench.checkpoints import write_checkpoint

        t0 = time.perf_counter()
        write_checkpoint("kimi-k2.5", args.model, "cuda", layers=args.layers)
        print(f"wrote {args.model} in {time.perf_counter() - t0:.0f} s", flush=True)
    shapes = SpecShapes(args.model)
    copy, flops = copy_bandwidth(), matmul_rate()
    torch.cuda.empty_cache()
    print(f"ceilings: copy {copy / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s", flush=True)
    ours, (llm, processed) = dayzero_numbers(args.model, args)
    print(f"dayzero: {ours}", flush=True)
    del llm
    torch.cuda.empty_cache()
    theirs = {} if args.no_transformers else transformers_numbers(args.model, args, processed)
    if theirs:
        print(f"transformers: {theirs}", flush=True)
    grid = tuple(ours["grid"])
    roof = {f"encoder_b{b}_s": encoder_flops(shapes.spec, [grid] * b) / flops for b in args.batches}
    roof["ttft_s"] = (encoder_flops(shapes.spec, [grid]) + shapes.prefill_flops(ours["ttft_prompt_tokens"], 1)) / flops
    print(f"\n{SIDE} x {SIDE} images: {grid[1]} x {grid[2]} patches, {ours['tokens_per_image']} tokens each; "
          f"preprocessing (Pillow, host) {ours['preprocess_images_per_s']:.1f} images/s")
    print(f"{'what':12} {'dayzero':>12} {'transformers':>13} {'roofline':>12} {'roof/ours':>10} {'hf/ours':>8}")
    for k in [f"encoder_b{b}_s" for b in args.batches] + ["ttft_s"]:
        b = int(k.split("_b")[1].split("_")[0]) if k.startswith("encoder") else None
        hf = theirs.get(k)

        def show(seconds):
            return f"{b / seconds:8.2f} im/s" if b else f"{seconds * 1e3:9.1f} ms"
        print(f"{k[:-2]:12} {show(ours[k]):>12} {'' if hf is None else show(hf):>13} {show(roof[k]):>12} "
              f"{roof[k] / ours[k]:10.2f} {'' if hf is None else f'{hf / ours[k]:8.2f}'}")
    print(f"ttft prompt: {ours['ttft_prompt_tokens']} tokens, {shapes.spec.num_layers} text layers (bench/checkpoints.py "
          "kimi-k2.5); "
          f"dayzero peak GPU memory {ours['peak_gib']:.1f} GiB")
    if args.json:
        args.json.write_text(json.dumps({"dayzero": ours, "transformers": theirs, "roofline_s": roof,
                                         "copy_Bps": copy, "bf16_flops": flops}, indent=1))


if __name__ == "__main__":
    main()
