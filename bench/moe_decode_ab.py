"""Path A's decode gate/up GEMM from this tree against another version of dayzero/kernels/moe_decode.py, in
the same run (CUDA graphs, three weight copies rotating, median of --reps; each measured --repeat times):

    git show 539ac24:dayzero/kernels/moe_decode.py > /tmp/moe_decode_old.py   # three-PRMT signed bytes
    python3 bench/moe_decode_ab.py --old /tmp/moe_decode_old.py

The other version must keep decode_gemm's and quantize_rows' signatures (the hand prefetch, stages 0).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.moe import MODELS, graph_replay_us, random_experts  # noqa: E402
from bench.moe_decode import _act, tiles_arg, words  # noqa: E402


def load(path: Path, name: str = "moe_decode_other"):
    """Import the Python file at path as module `name` (Triton reads its kernels' source from the file)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", type=Path, required=True, help="another version of moe_decode.py")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tiles", type=tiles_arg, default=[(64, 256, 8, 0), (32, 256, 8, 0), (32, 256, 4, 0)])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/moe_decode_ab.py needs a CUDA device")
    from dayzero.kernels import moe_decode as new
    from dayzero.kernels.moe_dispatch import dispatch

    versions = (("other", load(args.old)), ("this tree", new))
    print("| model | T | tile | " + " | ".join(f"{v} µs" for v, _ in versions) + " | this / other |")
    print("|---|---|---|---|---|---|")
    for name, (E, k, H, I, act, bias) in MODELS.items():
        gen = torch.Generator(device="cuda").manual_seed(0)
        sets = [random_experts(E, H, I, bias, gen) for _ in range(3)]
        ws = [words(e) for e in sets]
        for T in args.tokens:
            x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
            ids = torch.rand(T, E, device="cuda", generator=gen).argsort(dim=1)[:, :k]
            d = dispatch(ids, E, 1)
            for tile in args.tiles:
                times = []
                for _, mod in versions:
                    xq, xs = mod.quantize_rows(x)
                    f = lambda s: mod.decode_gemm(  # noqa: E731
                        xq, xs, ws[s][0], ws[s][1], sets[0].b13, d, out_features=I, gather=True, activation=_act(act),
                        alpha=act.alpha or 1.0, limit=act.limit, block_n=tile[0], block_k=tile[1], num_warps=tile[2])
                    times.append(min(graph_replay_us(f, 3, args.reps) for _ in range(args.repeat)))
                print(f"| {name} | {T} | {tile[0]}x{tile[1]}x{tile[2]} | {times[0]:.1f} | {times[1]:.1f} | "
                      f"{times[1] / times[0]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
