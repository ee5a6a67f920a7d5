"""Run the routed-expert layer as the kernel library chooses it (the decode kernels at decode sizes) a few
times on one GPU, for an external profiler:

    ncu --kernel-name regex:_moe_decode --launch-skip 4 --launch-count 2 --section SpeedOfLight \
        python3 tools/run_decode_layer.py --model gpt-oss-120b --tokens 8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.moe import MODELS, random_experts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt-oss-120b", choices=list(MODELS))
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--calls", type=int, default=4)
    args = ap.parse_args()
    from dayzero.kernels.moe import moe_experts_mxfp4

    E, k, H, I, act, bias = MODELS[args.model]
    gen = torch.Generator(device="cuda").manual_seed(0)
    experts = random_experts(E, H, I, bias, gen)
    x = torch.randn(args.tokens, H, device="cuda", generator=gen).bfloat16()
    ids = torch.rand(args.tokens, E, device="cuda", generator=gen).argsort(dim=1)[:, :k]
    w = torch.softmax(torch.randn(args.tokens, k, device="cuda", generator=gen), -1)
    for _ in range(args.calls):
        moe_experts_mxfp4(x, ids, w, experts, act)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
