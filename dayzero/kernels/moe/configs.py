"""The tile configurations of the routed-expert kernels, one dataclass per kernel (plain Python, no Triton).

choose.py picks one per call from the shapes and the device; a benchmark or a test pins one by passing
`Plan(kernel, config)` to the layer. Each validates itself, so a pinned config the kernel cannot run
raises ValueError naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

TAIL_BLOCK = 64  # default rows of the wgmma kernel's tail blocks (WgmmaConfig.tail_rows)
PREP_MAX_PAIRS = 512  # the most (token, slot) pairs the decode layer's one-launch dispatch (prep) takes


@dataclass(frozen=True)
class GemmConfig:
    """Tiles of the transposed tensor-core GEMM (_gemm.py: acc[BLOCK_N weights, BLOCK_M rows]) and of the
    FP8 GEMM (_fp8.py, BLOCK_K = 128 there). A layer takes a (gate/up, down) pair of one BLOCK_M."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class MmaConfig:
    """Tiles of the prefill GEMM (_mma.py: acc[BLOCK_M rows, BLOCK_N outputs]). block_n is per accumulator
    (the gated GEMM holds two: gate and up); group_m consecutive blocks run their N tiles together."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8


@dataclass(frozen=True)
class WgmmaConfig:
    """Tiles of the Gluon prefill GEMM on sm_90 (_wgmma.py). block_t: padded rows per program (the
    dispatch's block_m); pipeline: two register sets for the upcast tile, so one wgmma stays in flight
    (the kernel's comment says why two); tail_blocks: split each expert's last rows into up to this many
    blocks of tail_rows rows, run by a second launch."""
    block_t: int
    num_stages: int = 4
    group_m: int = 8
    pipeline: bool = False
    tail_blocks: int = 0
    tail_rows: int = TAIL_BLOCK

    def __post_init__(self):
        if self.block_t not in (16, 32, 64, 128, 256):
            raise ValueError(f"WgmmaConfig: block_t must be a power of two from 16 to 256, got {self.block_t}")
        if self.tail_rows not in (16, 32, 64):
            raise ValueError(f"WgmmaConfig: tail_rows must be 16, 32 or 64, got {self.tail_rows}")
        if self.tail_blocks and not 0 < self.tail_blocks < self.block_t // self.tail_rows:
            raise ValueError(f"WgmmaConfig: tail_blocks must be below block_t / tail_rows = "
                             f"{self.block_t // self.tail_rows}, got {self.tail_blocks}")
        if self.num_stages < 2 or self.group_m < 1:
            raise ValueError(f"WgmmaConfig: num_stages >= 2 and group_m >= 1, got {self.num_stages}, {self.group_m}")


@dataclass(frozen=True)
class DecodeConfig:
    """Tiles of the decode layer (_decode.py). block_m: padded rows per dispatch block (1, 2 or 4); with
    block_m 1 the dispatch is in pair order (block b is pair b, unsorted, each GEMM reads its expert from
    topk_ids) wherever the call has at most 512 pairs. Per GEMM (1: gate/up, 2: down): block_n, outputs
    per program (gate/up: intermediate columns, a multiple of 32); block_k, K per loop step (a power of two
    >= 32, capped at K); num_warps; stages: 0 = weight tiles prefetched by hand two steps ahead in
    registers, n >= 2 = Triton's software pipeline with n stages (tiles through shared memory: fewer
    registers, more programs and bytes in flight per SM).

    early2 (stages2 0): the down GEMM loads its first two weight tiles before it waits for the gate/up
    GEMM (PDL; its experts come from the dispatch, written two launches back).
    gluon1 / gluon2 (block_m 1, stages >= 2): that GEMM runs _decode_sm90's Gluon kernel (sm_90 only), its
    weight tiles copied into a ring of `stages` shared-memory slots, stages - 1 of them requested before
    the PDL wait."""
    block_m: int
    block_n1: int
    block_n2: int
    block_k1: int = 256
    block_k2: int = 256
    num_warps1: int = 4
    num_warps2: int = 4
    stages1: int = 0
    stages2: int = 0
    early2: bool = False
    gluon1: bool = False
    gluon2: bool = False

    def __post_init__(self):
        if self.block_m not in (1, 2, 4):
            raise ValueError(f"DecodeConfig: block_m must be 1, 2 or 4, got {self.block_m}")
        if self.stages1 == 1 or self.stages2 == 1:
            raise ValueError(f"DecodeConfig: stages must be 0 or at least 2, got {self.stages1}, {self.stages2}")
        if self.early2 and self.stages2:
            raise ValueError(f"DecodeConfig: early2 loads the hand prefetch's tiles early: it needs stages2 0, "
                             f"got {self.stages2}")
        for name, gluon, stages in (("gluon1", self.gluon1, self.stages1), ("gluon2", self.gluon2, self.stages2)):
            if gluon and (self.block_m != 1 or stages < 2):
                raise ValueError(f"DecodeConfig: a Gluon GEMM ({name}) runs the pair-order dispatch of block_m 1 "
                                 f"through a ring of >= 2 stages, got block_m {self.block_m}, stages {stages}")

    @property
    def gluon(self) -> bool:
        return self.gluon1 or self.gluon2
