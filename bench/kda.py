"""KDA (Kimi Linear / Kimi K3's delta attention) on one GPU: dayzero's path against fla-core's kernels
called directly on the same shapes, in one run (needs fla-core: `pip install fla-core einops`, or carry
tools/device_wheels.sh's wheels).

    python bench/kda.py            # Kimi Linear's 32 heads of 128; prompts 1K .. 32K, decode batch 1 .. 256
    python bench/kda.py --quick

Ours is what the model layer (dayzero/models/kimi_linear.DeltaAttention) does per step: the requests'
recurrent states in a state pool (float32 [slots, H, dk, dv], slots shuffled): prompts gather them,
run ops.kda_chunk and write the final states back; decodes run ops.kda_recurrent_slots, which reads and
writes the slots in place (fla's continuous-batching kernel). fla's is chunk_kda / fused_recurrent_kda
alone on the same q, k, v, g, beta and a contiguous initial state, as a caller of fla's API gets it. Issue 28's targets: prompts within 1.2x of fla's chunk_kda; a decode step
independent of the context (the state is [H, dk, dv] whatever the length: the decode rows are timed
once per batch size, with the prompt lengths that came before them irrelevant by construction).
Roofline of a decode step: the states read and written (8 bytes x H x dk x dv per request) over the copy
bandwidth measured here. Each timing is a CUDA graph replay (GPU time), median of --reps."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.moe import copy_bandwidth, graph_replay_us, median_ms  # noqa: E402
from dayzero import ops  # noqa: E402
from dayzero.kernels.kda import fla_available  # noqa: E402
from dayzero.ops.registry import REGISTRY  # noqa: E402

HEADS, DIM = 32, 128
PROMPTS = [(1, 1024), (1, 4096), (1, 16384), (1, 32768), (4, 4096)]  # (batch, tokens)
DECODE = [1, 16, 64, 256]


def inputs(b: int, t: int, gen):
    rand = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    q, k, v = (rand(b, t, HEADS, DIM).bfloat16() for _ in range(3))
    g = -torch.rand(b, t, HEADS, DIM, generator=gen, device="cuda") * 0.5  # log decay, float32 as kda_gate's
    beta = torch.rand(b, t, HEADS, generator=gen, device="cuda").bfloat16()
    return q, k, v, g, beta


def timings(b: int, t: int, reps: int, gen) -> tuple[float, float, str]:
    """(ours µs, fla µs, our backend) for a batch of b requests of t new tokens each."""
    from fla.ops.kda import chunk_kda, fused_recurrent_kda

    q, k, v, g, beta = inputs(b, t, gen)
    pool = torch.randn(4 * b + 7, HEADS, DIM, DIM, generator=gen, device="cuda") * 0.1
    slots = torch.randperm(pool.shape[0], generator=gen, device="cuda")[:b]
    state0 = pool[slots].clone()
    fla = fused_recurrent_kda if t == 1 else chunk_kda

    def ours(i):
        if t == 1:  # the slots updated in place
            return ops.kda_recurrent_slots(q, k, v, g, beta, pool, slots)
        o, final = ops.kda_chunk(q, k, v, g, beta, pool[slots])
        pool[slots] = final
        return o

    def theirs(i):
        return fla(q, k, v, g, beta, initial_state=state0, output_final_state=True, use_qk_l2norm_in_kernel=True)

    with REGISTRY.record_calls(by_backend=True) as calls:
        ours(0)
        theirs(0)  # fla autotunes on its first call, outside the graphs
    return timed_us(ours, reps), timed_us(theirs, reps), ", ".join(sorted(calls))


def timed_us(fn, reps: int) -> float:
    """A CUDA graph replay; eager (CUDA events, launch overhead included) where fn does not capture."""
    try:
        return graph_replay_us(fn, 1, reps)
    except RuntimeError as e:
        print(f"  not capturable ({str(e).splitlines()[0][:100]}): timed eagerly", flush=True)
        torch.cuda.synchronize()
        return 1e3 * median_ms(fn, reps, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int)
    args = ap.parse_args()
    if not fla_available():
        sys.exit("bench/kda.py: needs CUDA and fla-core (pip install fla-core einops)")
    reps = args.reps or (5 if args.quick else 20)
    gen = torch.Generator(device="cuda").manual_seed(0)
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s; KDA {HEADS} heads x {DIM}, bf16, float32 state",
          flush=True)
    rows = ["| step | ours µs | fla µs | ours / fla | roofline µs |", "|---|---|---|---|---|"]
    for b, t in PROMPTS:
        us, fla_us, backends = timings(b, t, reps, gen)
        rows.append(f"| prefill {b} x {t} | {us:.1f} | {fla_us:.1f} | {us / fla_us:.2f} | |")
        print(rows[-1], f"  {backends}", flush=True)
    for b in DECODE:
        us, fla_us, backends = timings(b, 1, reps, gen)
        roof = 1e6 * b * HEADS * DIM * DIM * 8 / bw
        rows.append(f"| decode batch {b} | {us:.1f} | {fla_us:.1f} | {us / fla_us:.2f} | {roof:.1f} |")
        print(rows[-1], f"  {backends}", flush=True)
    print("\n" + "\n".join(rows))


if __name__ == "__main__":
    main()
