"""Where the Gluon prefill GEMM's time goes: the two GEMMs of the wgmma kernel (dayzero/kernels/moe/_wgmma.py)
at one tile, timed in turn (bench/moe.interleaved_us) against copies of the kernel module with the weight
upcast made cheaper. A diagnostic: the variants compute wrong numbers on purpose (their outputs are not
checked).

    python3 tools/diag_wgmma_upcast.py --tokens 8192 --config 'WgmmaConfig(256, 3, pipeline=True)'

Variants: "real" (the module as it is), "nomul" (the bits of each code pair without the bf16 multiply
by the scale), "cheap" (each weight word reinterpreted as bf16 pairs: one shift per pair, no masks,
no multiply; same loads, layouts, MMAs and epilogue), "noepi" (the epilogue replaced by one store of
the accumulator's sum per program: no activation, bias, router weight or row stores), "cheap+noepi". If
"cheap" is much faster than "real", the upcast bounds the kernel; "noepi" measures the epilogue.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.moe import MODELS, interleaved_us, mxfp4_copies, random_experts  # noqa: E402
from dayzero.kernels.moe import _wgmma as moe_wgmma  # noqa: E402
from dayzero.kernels.moe.configs import WgmmaConfig  # noqa: E402

PAIR_BITS = """    t = words >> SHIFT
    return ((t & 0x00070007) << 6) | ((t & 0x00080008) << 12)
"""
MUL = """    return gl.inline_asm_elementwise(
        "{ .reg .b32 t; mul.rn.bf16x2 t, $2, $3; mov.b32 {$0, $1}, t; }",
        "=h,=h,r,r", [bits, f1], dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=1)
"""
NO_MUL = """    return gl.inline_asm_elementwise(
        "{ mov.b32 {$0, $1}, $2; }",
        "=h,=h,r,r", [bits, f1], dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=1)
"""
EPILOGUE = """        _epilogue(acc, row0, row_end, n0, expert,"""
NO_EPILOGUE = """        gl.store(out_ptr + pid, gl.sum(gl.sum(acc, axis=1), axis=0).to(gl.bfloat16))
        if False:
            _epilogue(acc, row0, row_end, n0, expert,"""
CHEAP = [(MUL, NO_MUL), (PAIR_BITS, "    return words >> SHIFT\n")]
VARIANTS = {"nomul": [(MUL, NO_MUL)], "cheap": CHEAP, "noepi": [(EPILOGUE, NO_EPILOGUE)],
            "cheap+noepi": CHEAP + [(EPILOGUE, NO_EPILOGUE)]}


def variant_module(name: str, tmp: Path):
    """A copy of the kernel module with VARIANTS[name] applied, imported under its own name."""
    src = inspect.getsource(moe_wgmma)
    for old, new in VARIANTS[name]:
        assert old in src, (name, old)
        src = src.replace(old, new)
    path = tmp / f"wgmma_{name.replace('+', '_')}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # Gluon resolves a kernel's globals through its module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192])
    ap.add_argument("--config", default="WgmmaConfig(256, 3, pipeline=True)",
                    help="a WgmmaConfig expression (kernels/moe/configs.py)")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    cfg = eval(args.config, {"__builtins__": {}}, {"WgmmaConfig": WgmmaConfig})  # noqa: S307 (a tool's flag)
    text = args.config
    tmp = Path(tempfile.mkdtemp())
    mods = {"real": moe_wgmma, **{v: variant_module(v, tmp) for v in VARIANTS}}
    for name in args.models:
        E, k, H, I, act, bias = MODELS[name]
        gen = torch.Generator(device="cuda").manual_seed(0)
        base = random_experts(E, H, I, bias, gen)
        sets = mxfp4_copies(base, 3)
        words = [(e.w13.view(torch.int32).view(E, 2 * I, H // 8), e.w13_scale, e.w2.view(torch.int32).view(E, H, I // 8),
                  e.w2_scale) for e in sets]
        for T in args.tokens:
            x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
            ids = torch.rand(T, E, device="cuda", generator=gen).argsort(dim=1)[:, :k]
            rw = torch.softmax(torch.randn(T, k, device="cuda", generator=gen), -1)
            d, runs = moe_wgmma.launches(ids, E, cfg)
            xp = moe_wgmma.gather_permute(x, d, gather=True)
            fns = {v: (lambda s, m=m: m.expert_gemms(xp, d, runs, *words[s], base.b13, base.b2, act, rw, inter=I,
                                                       high_scales=False))
                   for v, m in mods.items()}
            us = interleaved_us(fns, len(sets), args.reps)
            fl = 2 * T * k * 3 * H * I
            for v, t in us.items():
                print(f"{name:>13} T={T:>5} {text} {v:>6}: {t:9.1f} us {fl / t / 1e6:6.1f} TF/s "
                      f"(real / this {us['real'] / t:.2f})", flush=True)


if __name__ == "__main__":
    main()
