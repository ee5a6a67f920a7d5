"""The one place the routed-expert layer's kernel is chosen: `choose(shapes, device, settings)` -> Plan
(path, kernel variant, tile configuration, and whether an eager call replays a layer graph). Plain
Python (no Triton, no tensors): a benchmark or a test can ask it what runs, and pin a plan instead.

Kernel variants per op (KERNELS; `dayzero ops` lists them, DAYZERO_VARIANT=op=variant forces one):

    moe_experts_mxfp4  decode       path A at few rows per expert: int8 activations x E2M1 codes by dp4a
                       decode_sm90  path A at one token on sm_90: the same decode GEMMs in Gluon
                       gemm         path A: transposed tensor-core GEMM, weights upcast in registers
                       mma          path A at many rows per expert: tokens x upcast weights on the tensor cores
                       wgmma        path A above a few rows per expert on sm_90: Gluon, weights upcast into
                                    the wgmma register operand
                       fp8          path B: the active experts converted to FP8 into the workspace, FP8 GEMM
    moe_experts_bf16   gemm, mma    path C (bf16 experts), as above
    moe_experts_fp8    fp8          the FP8 GEMM on stored FP8 experts (DeepSeek-V3)

The rules, r = expected rows per active expert (pairs over the experts uniform routing activates):

- MXFP4 on sm_90 (compiled): decode up to r = 2.5 (decode_sm90 at one token where its tiles fit),
  else wgmma. Path B is never chosen there: wgmma beats a warm path B at every size measured.
- MXFP4 elsewhere: decode up to r = 3.5, else mma above r = 8, else gemm; path B instead where the
  layer's workspace already holds every expert of the layer (the call converts nothing), the call has
  DAYZERO_MOE_B_MIN_TOKENS to DAYZERO_MOE_B_MAX_TOKENS (excluded) tokens and no CUDA graph is being
  captured: there a warm B measured faster than mma (a cold B is slower at every size).
- bf16: mma above r = 48, else gemm. FP8 experts: fp8.
- Eager calls of up to DAYZERO_MOE_GRAPH_MAX_TOKENS tokens on CUDA (compiled, not during a capture, not
  path B, which synchronises with the host) replay a CUDA graph of the layer (_graphs.py): the plan is
  then chosen for the graph's bucket (tokens rounded up to a power of two) and Plan.graph_tokens says so.

Forcing a variant skips the rules but not the limits: a Gluon variant needs a compiled sm_90 device,
decode_sm90 one token's pair-order dispatch (at most 512 pairs) and tiles that fit the shapes, fp8 a
workspace; otherwise ValueError naming DAYZERO_VARIANT.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch

from dayzero.kernels.devices import capability, sm_count
from dayzero.kernels.moe.configs import PREP_MAX_PAIRS, DecodeConfig, GemmConfig, MmaConfig, WgmmaConfig
from dayzero.settings import Settings

KERNELS = {  # op -> {variant: what it is}, in the order `dayzero ops` lists them
    "moe_experts_mxfp4": {
        "decode": "path A, few rows per expert: int8 activations x E2M1 codes by dp4a (Triton)",
        "decode_sm90": "path A at one token on sm_90: the decode GEMMs in Gluon",
        "gemm": "path A: transposed tensor-core GEMM, weights upcast in registers (Triton)",
        "mma": "path A, many rows per expert: tokens x upcast weights on the tensor cores (Triton)",
        "wgmma": "path A on sm_90 above 2.5 rows per expert: weights upcast into the wgmma operand (Gluon)",
        "fp8": "path B: active experts converted to FP8 into the workspace, FP8 GEMM (one host sync)",
    },
    "moe_experts_bf16": {
        "gemm": "path C: transposed tensor-core GEMM (Triton)",
        "mma": "path C, many rows per expert: tokens x weights on the tensor cores (Triton)",
    },
    "moe_experts_fp8": {"fp8": "FP8 grouped GEMM on the stored FP8 experts, 128 x 128 block scales (Triton)"},
}
OP_OF_FORMAT = {"mxfp4": "moe_experts_mxfp4", "bf16": "moe_experts_bf16", "fp8": "moe_experts_fp8"}
GLUON_KERNELS = ("decode_sm90", "wgmma")  # compiled for sm_90 only (Gluon has no interpreter)

DECODE_MAX_ROWS = 3.5  # r up to which the decode kernels beat the tensor-core kernels (gemm, mma)
DECODE_MAX_ROWS_WGMMA = 2.5  # ... where wgmma runs: its 16-row blocks win above (1.08x at 3.2 rows)
MMA_MIN_ROWS = {"mxfp4": 8, "bf16": 48}  # r above which mma beats gemm
FP8_GROUP = 128  # K values per FP8 scale (weights and activations)

# One token on sm_90: the Gluon GEMMs' (block_n, block_k, warps, ring slots) of gate/up and down,
# 1.20x / 1.14x the Triton decode layer (gpt-oss-120b / DeepSeek-V4 shapes); from 8 tokens the Triton
# kernels stay (the Gluon GEMMs measured 0.87-1.04x there).
GLUON_ONE_TOKEN = ((32, 256, 8, 3), (32, 512, 8, 3))


@dataclass(frozen=True)
class Shapes:
    """One layer call: weights "mxfp4" | "bf16" | "fp8"; tokens T; top_k k; experts E; hidden H
    (the experts' input and output width); inter I (the intermediate width)."""
    weights: str
    tokens: int
    top_k: int
    experts: int
    hidden: int
    inter: int

    @property
    def pairs(self) -> int:
        return self.tokens * self.top_k


@dataclass(frozen=True)
class Device:
    """What the choice needs to know of the device: its type ("cuda", "cpu"), compute capability and
    SM count (CUDA), whether Triton interprets kernels on the CPU, whether a CUDA graph is being captured."""
    type: str
    capability: tuple[int, int] = (0, 0)
    sms: int = 132
    interpreted: bool = False
    capturing: bool = False

    @classmethod
    def of(cls, device: torch.device, *, capturing: bool = False, interpreted: bool = False) -> "Device":
        """The facts of a torch.device (CUDA: its capability and SM count, looked up once per device)."""
        device = torch.device(device)
        if device.type != "cuda":
            return cls(device.type, interpreted=interpreted)
        return cls("cuda", capability(device), sm_count(device), interpreted, capturing)

    @property
    def compiled(self) -> bool:
        return self.type == "cuda" and not self.interpreted

    @property
    def sm90(self) -> bool:
        """Where the Gluon kernels run: a compiled sm_90 device."""
        return self.compiled and self.capability == (9, 0)


@dataclass(frozen=True)
class Plan:
    """What a call runs. kernel: a variant of KERNELS; config: its tiles (DecodeConfig, WgmmaConfig, or a
    (gate/up, down) pair of GemmConfig / MmaConfig; GemmConfig for fp8); graph_tokens: > 0 when the eager
    call replays a CUDA graph of the layer captured at that many tokens (the config is chosen for them)."""
    kernel: str
    config: object
    graph_tokens: int = 0

    def path(self, weights: str) -> str:
        """"A" (MXFP4 in registers), "B" (MXFP4 converted to FP8), "C" (bf16) or "fp8" (stored FP8)."""
        if weights == "mxfp4":
            return "B" if self.kernel == "fp8" else "A"
        return "C" if weights == "bf16" else "fp8"


def choose(shapes: Shapes, device: Device, settings: Settings, *, workspace_warm: bool = False) -> Plan:
    """The plan for a call (module docstring). workspace_warm: the layer's FP8 workspace holds every expert
    of the layer (asked only for MXFP4 within path B's token range). Cached per distinct argument set."""
    return _choose(shapes, device, settings, workspace_warm)


@functools.lru_cache(maxsize=4096)
def _choose(shapes: Shapes, device: Device, settings: Settings, warm: bool) -> Plan:
    op = OP_OF_FORMAT.get(shapes.weights)
    if op is None:
        raise ValueError(f"no routed-expert kernels for weights {shapes.weights!r}; known: {', '.join(OP_OF_FORMAT)}")
    forced = settings.variant(op)
    if forced is not None and forced not in KERNELS[op]:
        raise ValueError(f"DAYZERO_VARIANT: {op} has no variant {forced!r}; its variants: {', '.join(KERNELS[op])}")
    graph = graph_tokens(shapes, device, settings, forced)
    sized = replace(shapes, tokens=graph) if graph else shapes
    kernel = forced or _rule(sized, device, settings, warm)
    return Plan(kernel, _config(kernel, sized, device), graph)


def graph_tokens(shapes: Shapes, device: Device, settings: Settings, forced: str | None = None) -> int:
    """The layer-graph bucket an eager call replays (the token count rounded up to a power of two), or 0."""
    path_b = shapes.weights == "mxfp4" and forced == "fp8"
    if not device.compiled or device.capturing or path_b or not 0 < shapes.tokens <= settings.moe_graph_max_tokens:
        return 0
    if shapes.weights == "mxfp4" and forced is None and _path_b(shapes, device, settings, True):
        return 0  # path B could be chosen for these tokens (a graph bucket never reaches its range by default)
    return 1 << max(0, shapes.tokens - 1).bit_length()


def fp8_workspace_used(device: Device, settings: Settings) -> bool:
    """Whether choose() can ever pick path B for MXFP4 experts on `device`: forced, or chosen by the rule
    (CUDA other than sm_90). The engine reserves the FP8 workspace exactly where this holds."""
    forced = settings.variant("moe_experts_mxfp4")
    if forced is not None:
        return forced == "fp8"
    return device.type == "cuda" and not device.sm90 and settings.moe_b_min_tokens < settings.moe_b_max_tokens


def _path_b(shapes: Shapes, device: Device, settings: Settings, warm: bool) -> bool:
    return (fp8_workspace_used(device, settings) and warm and not device.capturing
            and settings.moe_b_min_tokens <= shapes.tokens < settings.moe_b_max_tokens)


def needs_workspace_state(shapes: Shapes, device: Device, settings: Settings) -> bool:
    """Whether choose() would ask whether the workspace is warm (MXFP4, path B's token range, B possible)."""
    return shapes.weights == "mxfp4" and _path_b(shapes, device, settings, True)


def _rule(shapes: Shapes, device: Device, settings: Settings, warm: bool) -> str:
    if shapes.weights == "fp8":
        return "fp8"
    if shapes.weights == "bf16":
        return "mma" if active_rows(shapes) > MMA_MIN_ROWS["bf16"] else "gemm"
    if _path_b(shapes, device, settings, warm):
        return "fp8"
    decode = decode_config(shapes, device, DECODE_MAX_ROWS_WGMMA if device.sm90 else DECODE_MAX_ROWS)
    if decode is not None:
        return "decode_sm90" if decode.gluon else "decode"
    if device.sm90:
        return "wgmma"
    return "mma" if active_rows(shapes) > MMA_MIN_ROWS["mxfp4"] else "gemm"


def _config(kernel: str, shapes: Shapes, device: Device):
    if kernel in GLUON_KERNELS and not device.sm90:
        raise ValueError(f"DAYZERO_VARIANT: {kernel} is a Gluon kernel, compiled for sm_90 only; this device is "
                         f"{device.type} {device.capability}{' (interpreted)' if device.interpreted else ''}")
    if kernel == "decode":
        return decode_config(shapes, device, math.inf, gluon=False)
    if kernel == "decode_sm90":
        config = decode_config(shapes, device, math.inf, gluon=True)
        if not config.gluon:
            raise ValueError(f"DAYZERO_VARIANT: decode_sm90 needs one token's pair-order dispatch (<= {PREP_MAX_PAIRS} "
                             f"pairs, one row per expert) and tiles that fit hidden {shapes.hidden} / intermediate "
                             f"{shapes.inter}; this call has {shapes.pairs} pairs")
        return config
    if kernel == "gemm":
        mxfp4 = shapes.weights == "mxfp4"
        return (gemm_config(shapes.pairs, shapes.experts, shapes.inter, mxfp4, True),
                gemm_config(shapes.pairs, shapes.experts, shapes.hidden, mxfp4, False))
    if kernel == "mma":
        return mma_configs(shapes)
    if kernel == "wgmma":
        return wgmma_config(shapes.pairs, shapes.experts)
    if kernel == "fp8":
        return fp8_configs(shapes.pairs, shapes.experts)
    raise ValueError(f"unknown routed-expert kernel {kernel!r}")


# -- rows per expert -----------------------------------------------------------------------------

def expected_active_experts(num_tokens: int, top_k: int, num_experts: int) -> float:
    """Distinct experts a step activates on average if each token picks top_k of E uniformly."""
    return num_experts * (1 - (1 - min(top_k, num_experts) / num_experts) ** num_tokens)


def rows_per_expert(shapes: Shapes) -> float:
    """Expected rows per active expert under uniform routing (the decode rule's measure)."""
    return shapes.pairs / max(1.0, expected_active_experts(shapes.tokens, shapes.top_k, shapes.experts))


def active_rows(shapes: Shapes) -> float:
    """Rows per expert as the tensor-core rules count them: pairs / min(experts, pairs)."""
    return shapes.pairs / max(1, min(shapes.experts, shapes.pairs))


# -- decode kernels ------------------------------------------------------------------------------

def gluon_tile_fits(block_n: int, block_k: int, num_warps: int) -> bool:
    """Whether _decode_sm90's layout covers a [block_n, block_k / 32, 4] tile without replicating rows:
    lanes along the 32-value blocks first (at most 32), then along rows, warps along rows."""
    kb = block_k // 32
    if block_k % 32 or kb & (kb - 1) or kb > 32:
        return False
    return block_n % ((32 // kb) * num_warps) == 0


def clamp_k(block_k: int, K: int) -> int:
    """The K tile a decode GEMM runs for block_k over K (never wider than K)."""
    return min(block_k, 1 << (K.bit_length() - 1))


def decode_config(shapes: Shapes, device: Device, max_rows: float, gluon: bool | None = None) -> DecodeConfig | None:
    """The decode kernels' tiles, or None above max_rows expected rows per active expert. gluon: use the
    Gluon GEMMs at one token where their tiles fit (default: where they run, a compiled sm_90 device).

    BLOCK_M 1 while experts see about one row, else 2 (4 past 2.5 rows). Triton's 3-stage pipeline
    through shared memory everywhere but one token's down GEMM (4-6% faster layers at one token, 11-19%
    at 8-32 tokens than the register prefetch). Gate/up: 32 x 512 over 8 warps where it has few programs
    (one token: K split over the warps), else 32 x 512 (BLOCK_M 1) or 32 x 256 of 4 warps. Down: 32 x 512
    at BLOCK_M 1 and 64 x 256 above; where the gate/up GEMM has few programs, the hand prefetch with its
    first two tiles loaded before the PDL wait (early2: 7-18% faster at one token, slower from 8 tokens),
    32 x 1024 over 8 warps where its programs fit three per SM."""
    T, k, E, H, I = shapes.tokens, shapes.top_k, shapes.experts, shapes.hidden, shapes.inter
    sms = device.sms if device.type == "cuda" else 132
    active = max(1.0, expected_active_experts(T, max(1, k), E))
    rows = shapes.pairs / active
    if rows > max_rows:
        return None
    block_m = 1 if rows <= 1.25 else 2 if rows <= 2.5 else 4
    few1 = active * I / 32 < 4 * sms  # the gate/up GEMM has few programs: one token
    n1, k1, w1 = (32, 512, 8) if few1 else (32, 512, 4) if block_m == 1 else (32, 256, 4)
    n2, k2, w2 = (64, 256, 4) if block_m > 1 and H % 64 == 0 else (32, 512, 4)
    s2, early2 = 3, False
    if few1:  # the down GEMM's first two tiles stream in while the gate/up GEMM finishes
        s2, early2 = 0, True
        if active * H / 32 <= 3 * sms:  # its programs fit 3 per SM: K over 8 warps
            n2, k2, w2 = 32, 1024, 8
    config = DecodeConfig(block_m, n1, n2, k1, k2, w1, w2, stages1=3, stages2=s2, early2=early2)
    if gluon is None:
        gluon = device.sm90
    if gluon and few1 and block_m == 1 and shapes.pairs <= PREP_MAX_PAIRS:
        (gn1, gk1, gw1, gs1), (gn2, gk2, gw2, gs2) = GLUON_ONE_TOKEN
        if I % gn1 == 0 and gluon_tile_fits(gn1, clamp_k(gk1, H), gw1):
            config = replace(config, gluon1=True, block_n1=gn1, block_k1=gk1, num_warps1=gw1, stages1=gs1)
        if H % gn2 == 0 and gluon_tile_fits(gn2, clamp_k(gk2, I), gw2):
            config = replace(config, gluon2=True, block_n2=gn2, block_k2=gk2, num_warps2=gw2, stages2=gs2,
                             early2=False)
    return config


# -- transposed tensor-core GEMM (_gemm.py) ------------------------------------------------------

def gemm_config(num_pairs: int, num_experts: int, n: int, mxfp4: bool, gated: bool) -> GemmConfig:
    """BLOCK_M from the average rows per active expert; BLOCK_N small enough that a decode step still has
    about 2 tiles per SM; large K steps at decode sizes (bytes in flight), BLOCK_K 64 for the large
    tiles (the upcast tiles and both gated accumulators stay in registers, no spills)."""
    active = max(1, min(num_experts, num_pairs))
    rows = num_pairs / active
    block_m = 16 if rows <= 24 else 32 if rows <= 48 else 64 if rows <= 96 else 128
    if block_m <= 32:
        block_n = 64 if active * -(-n // 64) >= 264 else 32
        block_k = 256 if mxfp4 and block_m == 16 and (block_n == 32 or not gated) else 128 if mxfp4 else 64
        return GemmConfig(block_m, block_n, block_k, num_warps=4, num_stages=4)
    if block_m == 64:
        return GemmConfig(block_m, 128, 64, num_warps=8, num_stages=3)
    return GemmConfig(block_m, 64 if gated else 128, 64, num_warps=8, num_stages=3)


# -- prefill GEMM (_mma.py) ----------------------------------------------------------------------

def mma_configs(shapes: Shapes) -> tuple[MmaConfig, MmaConfig]:
    """(gate/up, down) tiles by r = rows per active expert. MXFP4: the weight upcast bounds the kernel,
    so BLOCK_M follows the rows (less upcast per row, little padding): 64 up to r = 96 (BLOCK_N 128 where
    N is a multiple of 128), 256 for 160 < r <= 224 (one block per expert), else 128. bf16: 128 x 128
    tiles of 8 warps, the down GEMM 128 x 256 above r = 160."""
    r = active_rows(shapes)
    if shapes.weights != "mxfp4":
        down = MmaConfig(128, 256, 64, 8, 3) if r > 160 else MmaConfig(128, 128, 64, 8, 4)
        return MmaConfig(128, 128, 64, 8, 4), down
    if r <= 96:
        return (MmaConfig(64, 128 if shapes.inter % 128 == 0 else 64, 64, 4, 4),
                MmaConfig(64, 128 if shapes.hidden % 128 == 0 else 64, 64, 4, 4))
    if 160 < r <= 224:
        return MmaConfig(256, 64, 64, 8, 3), MmaConfig(256, 128, 64, 8, 3)
    return MmaConfig(128, 64, 64, 4, 4), MmaConfig(128, 128, 64, 8, 4)


# -- Gluon prefill GEMM (_wgmma.py) --------------------------------------------------------------

# Relative cost of one block per K step: a 256-row block of the pipelined kernel (one program per SM)
# 1.0; a tail block of 64 / 32 / 16 rows 0.8 / 0.72 / 0.54 (bound by the weight upcast, which does not
# shrink with the rows); a 128-row block of the register kernel (two programs per SM) 0.64.
_COST_TAIL = {64: 0.8, 32: 0.72, 16: 0.54}
_COST_128 = 0.64
# Up to 96 rows per expert, the register kernel's block cost by its rows, relative to 32 rows.
_COST_SMALL = {16: 0.94, 32: 1.0, 64: 1.23}


def _expected_cost(r: float, cost) -> float:
    """cost(rows of one expert) averaged over r - sqrt(r), r, r + sqrt(r) (routing spreads the counts)."""
    sd = math.sqrt(r)
    return sum(cost(max(1, round(c))) for c in (r - sd, r, r + sd)) / 3


def _poisson_blocks(r: float, rows: int) -> float:
    """The expected blocks of `rows` rows an expert needs when its row count is Poisson with mean r."""
    p, total, c = math.exp(-r), 0.0, 0
    while c <= r + 12 * math.sqrt(r) + 12:
        total += p * -(-c // rows)
        c += 1
        p *= r / c
    return total


def wgmma_config(num_pairs: int, num_experts: int) -> WgmmaConfig:
    """By r = pairs / min(experts, pairs). Up to 96: the cheapest of 16-, 32- and 64-row blocks of the
    register kernel by _COST_SMALL and the expected blocks per expert. Above: the cheapest of 256-row
    pipelined blocks, the same with each expert's last rows as one tail block of 64, 32 or 16 rows where
    they fit, and 128-row blocks (the padding of each layout is what separates them; more than one tail
    block never pays, each costs an upcast of the weights). At equal cost the tail layouts come first, 16
    rows first: their big blocks store no padding rows past their expert's last 16."""
    active = max(1, min(num_experts, num_pairs))
    r = num_pairs / active
    if r <= 96:
        return min((WgmmaConfig(bt) for bt in _COST_SMALL),
                   key=lambda c: _COST_SMALL[c.block_t] * _poisson_blocks(r, c.block_t))

    def split(c, rows):  # 256-row blocks, the last rows as one tail block of `rows` where they fit
        full, rem = divmod(-(-c // rows), 256 // rows)
        return full + (rem > 1) + _COST_TAIL[rows] * (rem == 1)

    options = [(_expected_cost(r, lambda c, t=t: split(c, t)),
                WgmmaConfig(256, 3, pipeline=True, tail_blocks=1, tail_rows=t)) for t in sorted(_COST_TAIL)]
    options.append((_expected_cost(r, lambda c: -(-c // 256)), WgmmaConfig(256, 3, pipeline=True)))
    options.append((_expected_cost(r, lambda c: _COST_128 * -(-c // 128)), WgmmaConfig(128)))
    return min(options, key=lambda o: o[0])[1]  # the first of equal costs


# -- FP8 GEMM (_fp8.py) --------------------------------------------------------------------------

def fp8_configs(num_pairs: int, num_experts: int) -> tuple[GemmConfig, GemmConfig]:
    """BLOCK_N 128 (the gate/up GEMM quantizes h per 128 outputs), BLOCK_K 128 (the scale group), BLOCK_M
    from the rows per active expert, at most 64 (two float32 accumulators of 128 x 64 in the gate/up
    GEMM; 128 spills): the best of a tile sweep on the H200 at 128 to 8192 tokens on both models."""
    rows = num_pairs / max(1, min(num_experts, num_pairs))
    if rows < 8:
        return GemmConfig(16, 128, FP8_GROUP, 4, 4), GemmConfig(16, 64, FP8_GROUP, 4, 4)
    block_m = 32 if rows < 40 else 64
    return GemmConfig(block_m, 128, FP8_GROUP, 8, 3), GemmConfig(block_m, 128, FP8_GROUP, 8, 3)


# -- memory ----------------------------------------------------------------------------------------

def expert_slot_bytes(inter: int, hidden: int) -> int:
    """Bytes of one expert converted for path B: FP8 values of w13 [2I, H] and w2 [H, I], and their float32
    scales (one per row per 128 of K)."""
    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    return 3 * inter * hidden + 4 * (2 * inter * cdiv(hidden, FP8_GROUP) + hidden * cdiv(inter, FP8_GROUP))


def workspace_bytes(weights: str, num_experts: int, top_k: int, hidden: int, inter: int, max_tokens: int,
                    device: Device, settings: Settings, gib: float | None = None) -> int:
    """Device bytes the routed-expert kernels need besides the weights: the FP8 expert workspace of path
    B, 0 wherever choose() never picks path B (fp8_workspace_used), so a memory budget that subtracts this
    and the kernels' own choice agree. Size: `gib` (the engine's argument), else DAYZERO_FP8_WORKSPACE_GIB,
    else every expert one step of max_tokens tokens can activate (min(E, top_k * max_tokens) slots)."""
    if weights != "mxfp4" or not fp8_workspace_used(device, settings):
        return 0
    gib = gib if gib is not None else settings.fp8_workspace_gib
    if gib is not None:
        return int(gib * 2**30)
    return min(num_experts, top_k * max_tokens) * expert_slot_bytes(inter, hidden)
