"""The decode GEMMs of path A in Gluon for sm_90, pair order (one program per pair and BLOCK_N outputs;
the "decode_sm90" kernel, at one token): the same arithmetic as _decode.py's Triton kernel (offset weight
bytes by two byte permutes per four codes, dp4a against 16-bit activations split into bytes, one float32
multiply-add per 32-value block), with the data movement written out instead of left to the compiler.

Why: in the Triton kernel a third of the main loop's instructions are not the decode or the dp4a
(tools/sass_moe_decode.py: 328 per K step for 16 weight words at one token, 208 of them PRMT, IDP,
LOP3, SHF): its software pipeline stages the activations through shared memory too, the scale bytes
arrive in one layout and move to the words' layout, and the loop carries its prefetched values. Here:

- The K loop is unrolled (K and BLOCK_K are constexpr: 3-16 steps), so nothing is carried between
  steps and every tile's slot and offsets are constants.
- Each thread loads exactly the weight words it decodes: the 4 words (32 codes) of one 32-value block
  for BLOCK_N / (rows the lanes and warps cover) rows; lanes run along the blocks first (consecutive
  16-byte chunks of a row: coalesced), then along rows; warps along rows. The gate/up GEMM holds a gate
  tile and an up tile in the same layout, so gate and up of an output sit in the same thread after the
  sum over K. The words are copied by cp.async into a ring of STAGES shared-memory slots that the same
  thread reads back, STAGES - 1 tiles in flight (registers alone hold too few tiles in flight within 80
  registers); the scale bytes stay in registers, one or two steps ahead, one byte per block in the words'
  layout.
- The activation words of a thread's block column are loaded at the start of each step from global
  memory (L1/L2: every program of a token reads the same row), in the layout the dp4a needs.
- The expert id comes from topk_ids (pair order), written two launches back, so the first STAGES - 1
  weight tiles are requested before the PDL wait, while the launch before finishes.

At one token (gate/up 32 x 256 x 8, down 32 x 512 x 8, 3 slots each: choose.GLUON_ONE_TOKEN) the layer
is 1.20x / 1.14x the Triton kernels on gpt-oss-120b / DeepSeek-V4 shapes; from 8 tokens 0.87-1.04x, so
the Triton kernel stays there.

The interface and outputs are _decode.decode_gemm's for a pair-order dispatch: h quantized into the
xq/xs layout (_decode.py's docstring) from the gate/up GEMM, float32 rows times the router weight from the
down GEMM; _dispatch.combine sums them. Only compiled for CUDA sm_90 (Gluon has no interpreter): the
Triton kernel runs under TRITON_INTERPRET, on other devices and for sorted dispatches (BLOCK_M 2 and 4).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from dayzero.kernels import pdl
from dayzero.kernels.moe._common import _activate
# elementwise helpers shared with the Triton kernels (Gluon calls triton.jit functions that need no layout)
from dayzero.kernels.moe._decode import _E2M1_BYTES_ASM, _dp4a, _e8m0_factor, _tile_start
from dayzero.kernels.moe.choose import gluon_tile_fits


@gluon.constexpr_function
def _tile_layout(block_n, kb, num_warps):  # choose.gluon_tile_fits says where it covers a tile
    lk = min(32, kb)
    lr = 32 // lk
    return gl.BlockedLayout([block_n // (lr * num_warps), 1, 4], [lr, lk, 1], [num_warps, 1, 1], [2, 1, 0])


@gluon.jit
def _split4(v, layout: gl.constexpr):
    """[..., 4] -> its four slices along the last dimension (held by one thread), each converted to
    `layout` (the same registers: the conversion moves no data)."""
    shape: gl.constexpr = v.shape
    if len(shape) == 3:
        a, b = gl.split(gl.reshape(v, [shape[0], shape[1], 2, 2]))
    else:
        a, b = gl.split(gl.reshape(v, [shape[0], 2, 2]))
    a0, a1 = gl.split(a)
    b0, b1 = gl.split(b)
    return (gl.convert_layout(a0, layout, assert_trivial=True), gl.convert_layout(b0, layout, assert_trivial=True),
            gl.convert_layout(a1, layout, assert_trivial=True), gl.convert_layout(b1, layout, assert_trivial=True))


@gluon.jit
def _tile_dot(words, scale, tables, x, L2: gl.constexpr, NORMAL: gl.constexpr):
    """float32 [BN, KB]: each 32-value block's dot product of a weight tile (int32 words [BN, KB, 4], E8M0
    bytes [BN, KB]) with the activation row x (_load_x: the four byte planes, each split into its four
    words per block, the block factors and the offset corrections as int32, [1, KB] each, in the tile's
    layout): _decode._block_dot's dp4a chains."""
    xh0, xh1, xl0, xl1, xs, xc = x
    t0, t1, t2, t3 = tables
    lo, hi = gl.inline_asm_elementwise(_E2M1_BYTES_ASM, "=r,=r,r,r,r,r,r", [words, t0, t1, t2, t3],
                                       dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
    wl = _split4(lo, L2)
    wh = _split4(hi, L2)
    isum = gl.zeros_like(wl[0])
    for j in gl.static_range(4):
        isum = _dp4a(wl[j], xh0[j], isum, "dp4a.u32.s32 $0, $1, $2, $3;")
        isum = _dp4a(wh[j], xh1[j], isum, "dp4a.u32.s32 $0, $1, $2, $3;")
    isum = isum * 256 + xc
    for j in gl.static_range(4):
        isum = _dp4a(wl[j], xl0[j], isum, "dp4a.u32.u32 $0, $1, $2, $3;")
        isum = _dp4a(wh[j], xl1[j], isum, "dp4a.u32.u32 $0, $1, $2, $3;")
    # |isum| <= 12 * 32 * 2^14 < 2^24: exact in float32, as are its products with the two powers of two
    return (isum.to(gl.float32) * xs) * _e8m0_factor(scale, NORMAL)


@gluon.jit
def _tile_scales(gs_rows, us_rows, kb_off, i, K: gl.constexpr, BK: gl.constexpr, GATED: gl.constexpr):
    """E8M0 bytes [BN, KB] of K tile i: gate (or the only) rows, then up rows (the gate bytes again when not
    GATED). The words come through shared memory (_copy_tiles)."""
    blk = gl.expand_dims(_tile_start(i * BK, K, BK) // 32 + kb_off, 0)
    gs = gl.load(gs_rows + blk)
    us = gs
    if GATED:
        us = gl.load(us_rows + blk)
    return gs, us


@gluon.jit
def _copy_tiles(g_smem, u_smem, g_ptrs, u_ptrs, i, K: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                GATED: gl.constexpr):
    """Start the asynchronous copies (cp.async, 16 bytes per thread and chunk) of K tile i into ring slot
    i % STAGES, one group; past the last tile an empty group, so that the groups count the steps."""
    STEPS: gl.constexpr = (K + BK - 1) // BK
    if i < STEPS:
        word = gl.multiple_of(_tile_start(i * BK, K, BK) // 8, 4)
        async_copy.async_copy_global_to_shared(g_smem.index(i % STAGES), g_ptrs + word)
        if GATED:
            async_copy.async_copy_global_to_shared(u_smem.index(i % STAGES), u_ptrs + word)
    async_copy.commit_group()


@gluon.jit
def _planes(p, L2: gl.constexpr):
    """A byte plane [KB, 4] -> its four words per block, each [1, KB] in the tile's [BN, KB] layout."""
    a, b, c, d = _split4(p, gl.SliceLayout(0, L2))
    return (gl.expand_dims(a, 0), gl.expand_dims(b, 0), gl.expand_dims(c, 0), gl.expand_dims(d, 0))


@gluon.jit
def _load_x(xq_row, xs_row, k0, K: gl.constexpr, BK: gl.constexpr, x_layout: gl.constexpr, L2: gl.constexpr):
    """Activation row (xq/xs layout of _decode.py) for the K tile of step k0: the four byte planes [KB, 4],
    the block factors [KB] (0 for blocks before k0, which the last partial tile reads twice) and the
    offset corrections [KB] (int32)."""
    KB: gl.constexpr = BK // 32
    kb_layout: gl.constexpr = gl.SliceLayout(1, x_layout)
    start = _tile_start(k0, K, BK)
    blk = start // 32 + gl.arange(0, KB, layout=kb_layout)
    word = gl.expand_dims(blk * 4, 1) + gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, x_layout)), 0)
    h0 = gl.load(xq_row + word)
    h1 = gl.load(xq_row + K // 8 + word)
    l0 = gl.load(xq_row + 2 * (K // 8) + word)
    l1 = gl.load(xq_row + 3 * (K // 8) + word)
    xs = gl.load(xs_row + blk, mask=blk >= k0 // 32, other=0.0)
    xc = gl.load(xs_row + K // 32 + blk).to(gl.int32, bitcast=True)
    kl: gl.constexpr = gl.SliceLayout(0, L2)
    return (_planes(h0, L2), _planes(h1, L2), _planes(l0, L2), _planes(l1, L2),
            gl.expand_dims(gl.convert_layout(xs, kl), 0), gl.expand_dims(gl.convert_layout(xc, kl), 0))


@gluon.jit
def _quantize_store(v, q_row, s_row, n0, N: gl.constexpr, BN: gl.constexpr, num_warps: gl.constexpr):
    """_decode._quantize_store in Gluon: float32 v [BN] (columns n0.. of one row, BN % 32 == 0) per 32
    values into the xq/xs layout; q_row/s_row point at the row."""
    NB: gl.constexpr = BN // 32
    lay: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 8, 4], [1, 1, num_warps], [2, 1, 0])
    flat: gl.constexpr = gl.BlockedLayout([4], [32], [num_warps], [0])
    vb = gl.convert_layout(gl.reshape(gl.convert_layout(v, flat), [NB, 8, 4]), lay)
    amax = gl.max(gl.max(gl.abs(vb), axis=2), axis=1)  # [NB]
    e = gl.maximum((amax.to(gl.int32, bitcast=True) >> 23) & 0xFF, 20)
    factor = ((267 - e) << 23).to(gl.float32, bitcast=True)  # 2^(140 - e)
    back = ((e - 14) << 23).to(gl.float32, bitcast=True)  # 2^(e - 141)
    finite = gl.sum(gl.sum((gl.abs(vb) < float("inf")).to(gl.int32), axis=2), axis=1) == 32
    back = gl.where(finite, back, float("nan"))
    scaled = vb * gl.expand_dims(gl.expand_dims(factor, 1), 2)
    q = (scaled + gl.where(scaled < 0, -0.5, 0.5)).to(gl.int32)  # round half away from zero
    q = gl.where(scaled == scaled, q, 0)
    byte_l: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(0, lay))
    shift = gl.expand_dims(gl.expand_dims(8 * gl.arange(0, 4, layout=byte_l), 0), 0)
    hi = gl.sum(((q >> 8) & 0xFF) << shift, axis=2)  # [NB, 8]: slot j holds k = 4j .. 4j + 3 of the block
    lo = gl.sum((q & 0xFF) << shift, axis=2)
    w_l: gl.constexpr = gl.SliceLayout(2, lay)
    blk = n0 // 32 + gl.arange(0, NB, layout=gl.SliceLayout(1, w_l))
    j = gl.arange(0, 8, layout=gl.SliceLayout(0, w_l))
    # slot j -> plane j % 2 (k = 8 g + 4 (p % 2) + byte), word g = j // 2 of the block
    dst = gl.expand_dims(blk * 4, 1) + gl.expand_dims((j % 2) * (N // 8) + j // 2, 0)
    gl.store(q_row + dst, hi)
    gl.store(q_row + 2 * (N // 8) + dst, lo)
    qsum = gl.sum(gl.sum(q, axis=2), axis=1)
    gl.store(s_row + blk, back)
    gl.store(s_row + N // 32 + blk, (-qsum * 24).to(gl.float32, bitcast=True))


@gluon.jit(do_not_specialize=["S", "E", "stride_be"])
def _decode_kernel(
    xq_ptr, xs_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, out_s_ptr, ids_ptr, router_weight_ptr,
    S, E, stride_be, alpha, limit,
    K: gl.constexpr, NW: gl.constexpr, OUT_N: gl.constexpr, TOP_K: gl.constexpr, GATHER: gl.constexpr,
    ACTIVATION: gl.constexpr, HAS_LIMIT: gl.constexpr, HAS_BIAS: gl.constexpr, ROUTER_WEIGHT: gl.constexpr,
    BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, NORMAL: gl.constexpr,
    PDL: gl.constexpr, num_warps: gl.constexpr,
):
    """Outputs n0..n0+BLOCK_N of pair program_id(0), expert ids_ptr[pair] (outside [0, E): nothing).
    Weights: NW rows of K per expert; with ACTIVATION the gate rows are n and the up rows OUT_N + n.
    GATHER: the activation row is the pair's token (x), else the pair's own row (h)."""
    GATED: gl.constexpr = ACTIVATION != 0
    KB: gl.constexpr = BLOCK_K // 32
    STEPS: gl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    L3: gl.constexpr = _tile_layout(BLOCK_N, KB, num_warps)
    L2: gl.constexpr = gl.SliceLayout(2, L3)  # [BN, KB]
    XL: gl.constexpr = gl.SliceLayout(0, L3)  # [KB, 4]
    NL: gl.constexpr = gl.SliceLayout(1, L2)  # [BN]
    KL: gl.constexpr = gl.SliceLayout(0, L2)  # [KB]
    pair = gl.program_id(0)
    n0 = gl.program_id(1) * BLOCK_N
    expert_id = gl.load(ids_ptr + pair)  # the router's topk id: written two launches back
    if (expert_id >= 0) & (expert_id < E):
        expert = expert_id.to(gl.int32)
        rows = n0 + gl.arange(0, BLOCK_N, layout=NL)
        kb_off = gl.arange(0, KB, layout=KL)
        wi = gl.expand_dims(gl.expand_dims(rows, 1), 2) * (K // 8) + gl.expand_dims(
            gl.expand_dims(kb_off * 4, 0), 2) + gl.expand_dims(gl.expand_dims(
                gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, L3))), 0), 0)
        w_base = w_ptr + expert.to(gl.int64) * (NW * (K // 8))
        s_base = s_ptr + expert.to(gl.int64) * (NW * (K // 32))
        g_ptrs = w_base + wi
        gs_rows = s_base + gl.expand_dims(rows, 1) * (K // 32)
        if GATED:
            u_ptrs = g_ptrs + OUT_N * (K // 8)
            us_rows = gs_rows + OUT_N * (K // 32)
        else:
            u_ptrs = g_ptrs
            us_rows = gs_rows
        # Tiles 0 .. STAGES - 2 are requested before the wait (weights and ids only); then tile
        # i + STAGES - 1 at step i, so STAGES - 1 tiles are in flight while one is decoded.
        # The words by cp.async into a ring of STAGES slots; the scales in registers, P steps ahead.
        D: gl.constexpr = STAGES - 1  # tiles of words in flight
        P: gl.constexpr = 2 if D > 1 else 1
        lay_s: gl.constexpr = gl.SwizzledSharedLayout(4, 1, 1, [2, 1, 0])  # [BN, KB, 4]
        g_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, KB, 4], lay_s)
        u_smem = g_smem
        if GATED:
            u_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, KB, 4], lay_s)
        for i in gl.static_range(D):
            _copy_tiles(g_smem, u_smem, g_ptrs, u_ptrs, i, K, BLOCK_K, STAGES, GATED)
        gsa, usa = _tile_scales(gs_rows, us_rows, kb_off, 0, K, BLOCK_K, GATED)
        gsb, usb = gsa, usa
        if P > 1 and STEPS > 1:
            gsb, usb = _tile_scales(gs_rows, us_rows, kb_off, 1, K, BLOCK_K, GATED)
        acc = gl.zeros([BLOCK_N, KB], gl.float32, L2)
        up_acc = acc
        if HAS_BIAS:
            b_row = bias_ptr + expert.to(gl.int64) * stride_be
            first = gl.expand_dims(kb_off == 0, 0)
            acc = gl.where(first, gl.expand_dims(gl.load(b_row + rows).to(gl.float32), 1), acc)
            if GATED:
                up_acc = gl.where(first, gl.expand_dims(gl.load(b_row + OUT_N + rows).to(gl.float32), 1), up_acc)
        pdl.start(PDL)
        if GATHER:
            a_row = pair // TOP_K
        else:
            a_row = pair
        xq_row = xq_ptr + a_row.to(gl.int64) * (K // 2)
        xs_row = xs_ptr + a_row.to(gl.int64) * (K // 16)
        if ROUTER_WEIGHT:
            rw = gl.load(router_weight_ptr + pair).to(gl.float32)
        # the byte-permute tables of _E2M1_BYTES_ASM (24 + 2|v| and 24 - 2|v|); E >> 31 == 0 keeps them
        # in registers
        zero = E >> 31
        tables = (zero + 0x1B1A1918, zero + 0x24201E1C, zero + 0x15161718, zero + 0x0C101214)
        for i in gl.static_range(STEPS):
            gsn, usn = gsa, usa
            if i + P < STEPS:
                gsn, usn = _tile_scales(gs_rows, us_rows, kb_off, i + P, K, BLOCK_K, GATED)
            x = _load_x(xq_row, xs_row, i * BLOCK_K, K, BLOCK_K, XL, L2)
            _copy_tiles(g_smem, u_smem, g_ptrs, u_ptrs, i + D, K, BLOCK_K, STAGES, GATED)
            async_copy.wait_group(D)
            ga = g_smem.index(i % STAGES).load(L3)
            if GATED:
                ua = u_smem.index(i % STAGES).load(L3)
            acc += _tile_dot(ga, gsa, tables, x, L2, NORMAL)
            if GATED:
                up_acc += _tile_dot(ua, usa, tables, x, L2, NORMAL)
            if P > 1:
                gsa, usa = gsb, usb
                gsb, usb = gsn, usn
            else:
                gsa, usa = gsn, usn
        v = gl.sum(acc, axis=1)  # [BN], NL
        if GATED:
            up = gl.sum(up_acc, axis=1)
            h = _activate(v, up, alpha, limit, ACTIVATION, HAS_LIMIT)
            _quantize_store(h, out_ptr + pair.to(gl.int64) * (OUT_N // 2), out_s_ptr + pair.to(gl.int64) * (OUT_N // 16),
                            n0, OUT_N, BLOCK_N, num_warps)
        else:
            if ROUTER_WEIGHT:
                v = v * rw
            gl.store(out_ptr + pair.to(gl.int64) * OUT_N + rows, v.to(out_ptr.dtype.element_ty))
    else:  # no expert: nothing to compute
        pdl.start(PDL)


def decode_gemm_sm90(xq, xs, w, scale, bias, pair_ids, *, top_k: int, out_features: int, gather: bool,
                     activation: int = 0, alpha: float = 1.0, limit: float | None = None, router_weights=None,
                     block_n: int, block_k: int, num_warps: int, stages: int = 3, normal_scales: bool = False):
    """_decode.decode_gemm for a pair-order dispatch (row = pair): w int32 words [E, NW, K/8], scale
    uint8 [E, NW, K/32], pair_ids the flat topk ids [S]. With an activation returns (hq, hs) [S, ...],
    else float32 [S, out_features] times the router weights. Rows of invalid pairs are left unwritten."""
    E, NW, words = w.shape
    K = words * 8
    S = pair_ids.shape[0]
    block_k = min(block_k, 1 << (K.bit_length() - 1))
    if out_features % block_n or (activation and block_n % 32) or not gluon_tile_fits(block_n, block_k, num_warps):
        raise ValueError(f"decode_gemm_sm90: tile {block_n} x {block_k} over {num_warps} warps does not fit "
                         f"{out_features} outputs")
    if stages < 2:
        raise ValueError(f"decode_gemm_sm90: stages (ring slots) must be at least 2, got {stages}")
    dev = xq.device
    if activation:
        out = torch.empty(S, 4, out_features // 8, dtype=torch.int32, device=dev)
        out_s = torch.empty(S, 2, out_features // 32, dtype=torch.float32, device=dev)
    else:  # float32, as _decode.decode_gemm's: combine rounds each token's sum once
        out = torch.empty(S, out_features, dtype=torch.float32, device=dev)
        out_s = None
    if S == 0:
        return (out, out_s) if activation else out
    dummy = pair_ids
    opts = pdl.launch_options(dev)
    _decode_kernel[(S, out_features // block_n)](
        xq, xs, w, scale, bias if bias is not None else dummy, out, out_s if out_s is not None else dummy, pair_ids,
        router_weights if router_weights is not None else dummy,
        S, E, bias.stride(0) if bias is not None else 0, float(alpha), float(limit) if limit is not None else 0.0,
        K=K, NW=NW, OUT_N=out_features, TOP_K=top_k, GATHER=gather, ACTIVATION=activation,
        HAS_LIMIT=limit is not None, HAS_BIAS=bias is not None, ROUTER_WEIGHT=router_weights is not None,
        BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, NORMAL=normal_scales, PDL=opts["PDL"],
        num_warps=num_warps, **({"launch_pdl": True} if opts["PDL"] else {}),
    )
    return (out, out_s) if activation else out
