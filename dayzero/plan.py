"""Parameter counts and a memory plan from a ModelSpec alone (no weights).

Conventions (docs/inspect.md explains each):
- Parameters are what the transformers model of the same config holds in `parameters()`: buffers
  (DeepSeek's e_score_correction_bias, V4's tid2eid hash table) and MTP modules are not counted.
- Active parameters are per token: everything except the input embedding table (a token reads
  one row) and the routed experts, plus top_k routed experts in every MoE layer (hash-routed
  layers too). Shared experts and lm_head count. This is how DeepSeek and OpenAI report theirs.
- Weight bytes per parameter: bf16 2; fp8 1 + scales (fp32 or ue8m0 per 128x128 block);
  mxfp4 0.5 + 1 B E8M0 per 32 = 0.53125; int4 (compressed-tensors) 0.5 + 2 B bf16 scale per 32.
  The quantized format applies to linear weights of its scope; embeddings, norms, biases,
  routers and other small tensors are counted at bf16 whatever their stored dtype.
- Cache bytes are what dayzero's paged storage allocates (dayzero/cache/layout.py, the same
  function the engine uses): a bf16 model, blocks of 16 tokens, each stream aligned to 16 B in a
  page; kv_dtype "fp8" is the engine's kv_cache_dtype "fp8_e4m3".
- The plan is first-order: weights and KV split evenly over GPUs (as if layers were pipelined
  across them), a reserve per GPU for activations and the expert workspace, the rest for the KV
  and recurrent state of one sequence.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from dayzero.cache.layout import DEFAULT_BLOCK_SIZE, cache_layout, layer_layout, window_blocks
from dayzero.spec import AttentionSpec, ExpertsSpec, LayerSpec, ModelSpec

GIB = 1024**3
H200_GPU_MEM_GIB = 141.0  # nominal HBM3e of one H200 (the driver shows about 139.8 GiB usable)

# Parameter categories; the format that stores each one is decided in `_category_format`.
CATEGORIES = (
    "embedding",  # input embedding table
    "lm_head",  # output projection (0 when tied)
    "attention",  # attention / KDA / indexer / compressor projections
    "dense_mlp",  # dense FFN layers
    "shared_experts",
    "routed_experts",
    "latent_projection",  # latent MoE down/up projections
    "router",
    "small",  # norms, biases, sinks, conv kernels, hyper-connection and attn-res mixers
    "vision",  # vision tower and projector
)


# -- parameter counting ----------------------------------------------------------------------


def _mla_params(a: AttentionSpec, hidden: int) -> dict[str, int]:
    lin = 0
    small = a.kv_lora_rank  # kv_a_layernorm
    if a.q_lora_rank:
        lin += hidden * a.q_lora_rank + a.q_lora_rank * a.num_heads * a.head_dim
        small += a.q_lora_rank  # q_a_layernorm
        if a.bias:
            small += a.q_lora_rank
    else:
        lin += hidden * a.num_heads * a.head_dim
    lin += hidden * (a.kv_lora_rank + a.qk_rope_head_dim)
    lin += a.kv_lora_rank * a.num_heads * (a.qk_nope_head_dim + a.v_head_dim)
    lin += a.num_heads * a.v_head_dim * hidden
    if a.bias:
        small += a.kv_lora_rank + a.qk_rope_head_dim + hidden
    if a.output_gate == "sigmoid":  # Kimi K3 gated MLA: g_proj hidden -> heads * v_head_dim
        lin += hidden * a.num_heads * a.v_head_dim
    if a.kind == "dsa":  # lightning indexer: wq_b, wk, LayerNorm(k), weights_proj
        lin += a.q_lora_rank * a.index_n_heads * a.index_head_dim + hidden * a.index_head_dim
        lin += hidden * a.index_n_heads
        small += 2 * a.index_head_dim
    return {"attention": lin, "small": small}


def _gqa_params(a: AttentionSpec, hidden: int) -> dict[str, int]:
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    lin = hidden * (q + 2 * kv) + q * hidden
    small = (q + 2 * kv + hidden if a.bias else 0) + (a.num_heads if a.sinks else 0)
    small += (q + 2 * kv if a.qkv_bias else 0) + (2 * a.head_dim if a.qk_norm else 0)
    if a.output_gate == "sigmoid":  # Qwen3.5: q_proj gives q and a gate per channel
        lin += hidden * q
        small += q if a.bias else 0
    return {"attention": lin, "small": small}


def _gdn_params(a: AttentionSpec, hidden: int) -> dict[str, int]:
    qk, v = a.num_kv_heads * a.head_dim, a.num_heads * a.v_head_dim
    lin = hidden * (2 * qk + v) + hidden * v + 2 * hidden * a.num_heads + v * hidden  # in_proj_{qkv,z,b,a}, out_proj
    small = (2 * qk + v) * a.conv_kernel + 2 * a.num_heads + a.v_head_dim  # conv1d, dt_bias, A_log, norm
    return {"attention": lin, "small": small}


def _v4_params(a: AttentionSpec, hidden: int) -> dict[str, int]:
    hd, heads = a.head_dim, a.num_heads
    lin = hidden * a.q_lora_rank + a.q_lora_rank * heads * hd + hidden * hd
    lin += (heads * hd // a.o_groups) * a.o_groups * a.o_lora_rank + a.o_groups * a.o_lora_rank * hidden
    small = a.q_lora_rank + hd + heads  # q_a_norm, kv_norm, sinks
    if a.kind == "hca":  # compressor: kv_proj, gate_proj (hidden -> head_dim), position_bias, kv_norm
        lin += 2 * hidden * hd
        small += a.compress_ratio * hd + hd
    elif a.kind == "csa":  # two overlapping series (2 * head_dim) plus the indexer's own compressor
        ihd = a.index_head_dim
        lin += 2 * hidden * 2 * hd + 2 * hidden * 2 * ihd
        lin += a.q_lora_rank * a.index_n_heads * ihd + hidden * a.index_n_heads
        small += a.compress_ratio * 2 * hd + hd + a.compress_ratio * 2 * ihd + ihd
    return {"attention": lin, "small": small}


def _kda_params(a: AttentionSpec, hidden: int) -> dict[str, int]:
    proj = a.num_heads * a.head_dim
    lin = 3 * hidden * proj + proj * hidden  # q, k, v, o
    lin += hidden * a.head_dim + a.head_dim * proj  # forget gate f_a, f_b (low rank)
    lin += hidden * a.num_heads  # beta b_proj
    lin += hidden * proj if a.output_gate == "full_rank" else hidden * a.head_dim + a.head_dim * proj
    small = 3 * proj * a.conv_kernel + proj + a.num_heads + a.head_dim  # conv, dt_bias, A_log, o_norm
    return {"attention": lin, "small": small}


def attention_params(a: AttentionSpec, hidden: int) -> dict[str, int]:
    if a.kind in ("mla", "dsa"):
        return _mla_params(a, hidden)
    if a.kind in ("swa", "gqa") and a.o_groups is None:
        return _gqa_params(a, hidden)
    if a.kind in ("swa", "csa", "hca"):
        return _v4_params(a, hidden)
    if a.kind == "gdn":
        return _gdn_params(a, hidden)
    return _kda_params(a, hidden)


def expert_params(e: ExpertsSpec) -> int:
    """Parameters of one routed expert: gate, up, down (+ biases for gpt-oss)."""
    n = 3 * e.input_dim * e.intermediate_size
    if e.bias:
        n += 2 * e.intermediate_size + e.input_dim
    return n


def layer_params(layer: LayerSpec, spec: ModelSpec) -> dict[str, int]:
    """Parameters of one decoder layer by category."""
    hidden = spec.hidden_size
    counts = dict.fromkeys(CATEGORIES, 0)
    for k, v in attention_params(layer.attention, hidden).items():
        counts[k] += v
    counts["small"] += 2 * hidden  # input and post-attention norms
    mlp = layer.mlp
    if mlp.kind == "dense":
        counts["dense_mlp"] += 3 * hidden * mlp.intermediate_size
    else:
        e = mlp.experts
        counts["routed_experts"] += e.num * expert_params(e)
        counts["router"] += e.num * hidden + (e.num if e.bias else 0) + (hidden if e.shared_gate else 0)
        counts["shared_experts"] += 3 * hidden * e.shared_intermediate_size
        if e.latent_dim:
            counts["latent_projection"] += 2 * hidden * e.latent_dim
            counts["small"] += e.latent_dim if e.latent_norm else 0
    if layer.cross_layer == "hyper_connection":  # attn_hc and ffn_hc: fn, base, scale
        m = spec.cross_layer.hc_mult
        counts["small"] += 2 * ((2 + m) * m * m * hidden + (2 + m) * m + 3)
    elif layer.cross_layer == "attention_residual":  # per block input: res_norm and res_proj, before attn and MLP
        counts["small"] += 4 * hidden
    return counts


def vision_params(spec: ModelSpec) -> int:
    v = spec.vision
    if v is None:
        return 0
    h, inter, merged = v.hidden_size, v.intermediate_size, v.hidden_size * v.merge_kernel[0] * v.merge_kernel[1]
    if v.kind == "qwen3_5_vit":  # Conv3d patches, learned positions; blocks of LayerNorms, biased qkv / proj / MLP
        per_layer = 4 * h + 3 * h * h + 3 * h + h * h + h + 2 * h * inter + inter + h
        patches = 3 * v.temporal_patch_size * v.patch_size ** 2 * h + h + v.num_positions * h
        merger = 2 * h + merged * merged + merged + merged * v.text_hidden_size + v.text_hidden_size
        return v.num_layers * per_layer + patches + merger
    b = 1 if v.bias else 0
    norm = 2 * h if v.norm == "layer_norm" else h
    qkv = v.qkv_hidden_size or h
    per_layer = 2 * norm + 3 * (h * qkv + b * qkv) + qkv * h + b * h + h * inter + b * inter + inter * h + b * h
    total = v.num_layers * per_layer + norm  # + final norm
    total += 3 * v.patch_size * v.patch_size * h + b * h  # patch embedding conv
    if v.pos_emb:
        total += v.pos_emb[0] * v.pos_emb[1] * h
    proj_in = v.projector_hidden_size if v.kind == "moonvit3d" else merged
    if v.kind == "moonvit":  # pre LayerNorm(projection_hidden_size), in_proj merged->merged, out_proj merged->text
        total += 2 * v.projector_hidden_size + merged * merged + merged + merged * v.text_hidden_size + v.text_hidden_size
    else:  # patchmergerv2 (estimate): merged -> merged -> text, RMSNorm after
        total += proj_in * proj_in + proj_in * v.text_hidden_size + v.text_hidden_size
    return total


def param_counts(spec: ModelSpec) -> dict[str, int]:
    """Total parameters by category (see CATEGORIES)."""
    counts = dict.fromkeys(CATEGORIES, 0)
    for layer in spec.layers:
        for k, v in layer_params(layer, spec).items():
            counts[k] += v
    hidden, vocab = spec.hidden_size, spec.vocab_size
    counts["embedding"] += vocab * hidden
    counts["lm_head"] += 0 if spec.tie_word_embeddings else vocab * hidden
    counts["small"] += hidden  # final norm
    if spec.cross_layer.kind == "hyper_connection":  # hyper-head: hc_fn, hc_base, hc_scale
        m = spec.cross_layer.hc_mult
        counts["small"] += m * m * hidden + m + 1
    elif spec.cross_layer.kind == "attention_residual":  # output mix: norm and proj
        counts["small"] += 2 * hidden
    counts["vision"] += vision_params(spec)
    return counts


def total_params(spec: ModelSpec) -> int:
    return sum(param_counts(spec).values())


def active_params(spec: ModelSpec) -> int:
    """Per-token parameters: all but the embedding table and the routed experts, plus top_k experts
    per MoE layer; the vision tower is excluded (it runs per image, not per token)."""
    counts = param_counts(spec)
    active = sum(v for k, v in counts.items() if k not in ("embedding", "routed_experts", "vision"))
    if spec.tie_word_embeddings:
        active += counts["embedding"]  # the tied table is read in full as lm_head
    for layer in spec.layers:
        if layer.mlp.experts is not None:
            active += layer.mlp.experts.top_k * expert_params(layer.mlp.experts)
    return active


# -- weight bytes ----------------------------------------------------------------------------


def bytes_per_param(fmt: str, *, fp8_block: tuple[int, int] | None = (128, 128), scale_fmt: str | None = "float",
                    group_size: int | None = 32) -> float:
    """Storage bytes per weight including its scales."""
    if fmt == "bf16":
        return 2.0
    if fmt == "fp8":
        block = fp8_block or (128, 128)
        scale_bytes = 1 if scale_fmt == "ue8m0" else 4
        return 1.0 + scale_bytes / (block[0] * block[1])
    if fmt == "mxfp4":
        return 0.5 + 1.0 / (group_size or 32)
    if fmt == "int4":
        return 0.5 + 2.0 / (group_size or 32)
    raise ValueError(f"unknown weight format {fmt!r}; known: bf16, fp8, mxfp4, int4")


def _category_format(spec: ModelSpec, category: str) -> str:
    q = spec.quant
    if category == "routed_experts":
        return q.expert_format
    if category in ("attention", "dense_mlp", "shared_experts", "latent_projection"):
        return q.dense_format
    return "bf16"


def weight_bytes(spec: ModelSpec) -> dict[str, float]:
    """Bytes by storage format ({"bf16": ..., "fp8": ..., "mxfp4": ...})."""
    q = spec.quant
    out: dict[str, float] = {}
    for category, n in param_counts(spec).items():
        if not n:
            continue
        fmt = _category_format(spec, category)
        group = q.group_size if fmt in ("mxfp4", "int4") else None
        out[fmt] = out.get(fmt, 0.0) + n * bytes_per_param(fmt, fp8_block=q.fp8_block, scale_fmt=q.scale_fmt, group_size=group)
    return out


# -- expert workspace --------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkspacePolicy:
    """The cross-layer FP8 expert workspace: experts stored in a 4-bit format (mxfp4, int4) are
    converted to FP8 (1 B + one fp32 scale per fp8_block: 1 x 128 along K, the layout of
    dayzero/kernels/moe/_workspace.py) when a layer's step activates them, into a buffer reused by
    every layer. Per GPU it holds `buffers` layers' worth of
    min(local experts, top_k * max_tokens_per_step) experts, local = ceil(num_experts / gpus)
    under an even expert split. buffers=2 lets the next layer convert while this one computes.
    """

    max_tokens_per_step: int = 8192
    buffers: int = 1
    fp8_block: tuple[int, int] = (1, 128)


def fp8_expert_bytes(experts, fp8_block: tuple[int, int] = (1, 128)) -> int:
    """One routed expert converted to FP8: w13 [2I, K] and w2 [K, I] (K = the experts' input dim)
    as e4m3 values plus one fp32 scale per fp8_block tile (partial tiles count whole)."""
    inter, k = experts.intermediate_size, experts.input_dim
    rows, cols = fp8_block

    def scales(n: int, kk: int) -> int:
        return -(-n // rows) * -(-kk // cols)

    return 3 * inter * k + 4 * (scales(2 * inter, k) + scales(k, inter))


def expert_workspace_bytes(spec: ModelSpec, gpus: int = 1, policy: WorkspacePolicy = WorkspacePolicy()) -> float:
    e = spec.experts
    if e is None or e.format not in ("mxfp4", "int4"):
        return 0.0
    local = -(-e.num // gpus)
    n = min(local, e.top_k * policy.max_tokens_per_step)
    return float(policy.buffers * n * fp8_expert_bytes(e, policy.fp8_block))


# -- KV cache and recurrent state --------------------------------------------------------------
# Every cache byte comes from dayzero/cache/layout.py, the function of the spec the engine's paged
# storage allocates from: the plan's bytes are the storage's, page alignment and block granularity
# included, for a bf16 model at the engine's default block size.

KV_DTYPES = {"bf16": "auto", "fp8": "fp8_e4m3"}  # the plan's KV dtype -> the engine's kv_cache_dtype
PLAN_DTYPE = torch.bfloat16  # the compute (and "auto" cache) dtype the plan assumes


def _kv_cache_dtype(kv_dtype: str) -> str:
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"KV dtype {kv_dtype!r} is not supported; choose one of {', '.join(KV_DTYPES)}")
    return KV_DTYPES[kv_dtype]


@dataclass(frozen=True)
class LayerCache:
    """One layer's cache for one sequence: bytes that grow with each token and bytes bounded
    (a window's blocks, compressor buffers, or a recurrent state). window: tokens the bounded part
    covers. detail: per stream bytes per token (full attention) or bytes (window), per state bytes."""

    per_token: float
    fixed: float
    window: int | None = None
    detail: dict = field(default_factory=dict)


def layer_cache(a: AttentionSpec, kv_dtype: str = "bf16", block_size: int = DEFAULT_BLOCK_SIZE) -> LayerCache:
    """kv_dtype: bf16 | fp8 (e4m3 + one fp32 scale per 128 values, as the paged storage keeps it:
    an MLA latent 512 + rope 64 is 596 B per token)."""
    layout = layer_layout(0, a, PLAN_DTYPE).with_kv_cache_dtype(_kv_cache_dtype(kv_dtype))
    per_token, fixed = layout.sequence_bytes(block_size)
    detail: dict = {}
    for s in layout.streams:
        b = s.block_bytes(block_size)
        detail[s.name] = b / block_size if s.window is None else window_blocks(s.window, block_size) * b
    detail.update({s.name: s.nbytes for s in layout.states})
    window = next((s.window for s in layout.streams if s.window is not None), None)
    return LayerCache(per_token, float(fixed), window, detail)


def kda_state_bytes(spec: ModelSpec) -> float:
    """Recurrent state of one request over all linear-attention layers (KDA, Gated DeltaNet)."""
    return sum(layer_cache(layer.attention).fixed for layer in spec.layers if layer.attention.kind in ("kda", "gdn"))


def cache_totals(spec: ModelSpec, kv_dtype: str = "bf16", block_size: int = DEFAULT_BLOCK_SIZE) -> tuple[float, float]:
    """(bytes per token, bounded bytes) of one sequence over all layers, as the paged storage holds it."""
    return cache_layout(spec, PLAN_DTYPE, _kv_cache_dtype(kv_dtype)).sequence_bytes(block_size)


# -- the plan ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryPlan:
    gpus: int
    gpu_mem_gib: float
    kv_dtype: str
    weights_gib: float
    weights_gib_per_gpu: float
    weights_gib_by_format: dict
    expert_workspace_gib_per_gpu: float
    activation_reserve_gib_per_gpu: float
    free_for_cache_gib_per_gpu: float
    cache_bytes_per_token: float
    cache_fixed_gib: float
    kda_state_gib_per_request: float
    max_context_tokens: int  # longest single sequence the free memory holds (not capped)
    context_limit: int  # min(max_context_tokens, max_position_embeddings)
    workspace_policy: dict
    context: int | None = None
    context_cache_gib: float | None = None
    context_fits: bool | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def context_fit(free: float, per_token: float, fixed: float, max_position: int,
                context: int | None = None) -> tuple[int, float | None, bool | None]:
    """One sequence in `free` cache bytes: (longest context, uncapped; GiB of a `context`-token sequence;
    whether it fits, within max_position too). fixed: its bounded bytes (windows, states)."""
    room = free - fixed
    if room <= 0:
        max_ctx = 0
    elif per_token == 0:
        max_ctx = max_position
    else:
        max_ctx = int(room // per_token)
    if context is None:
        return max_ctx, None, None
    return max_ctx, (context * per_token + fixed) / GIB, room >= context * per_token and context <= max_position


def memory_plan(
    spec: ModelSpec,
    gpus: int = 1,
    gpu_mem_gib: float = H200_GPU_MEM_GIB,
    *,
    context: int | None = None,
    kv_dtype: str = "bf16",
    activation_reserve_gib: float = 8.0,
    workspace: WorkspacePolicy = WorkspacePolicy(),
) -> MemoryPlan:
    """Fit one sequence: per GPU, free = gpu_mem - weights/gpus - workspace - activation reserve;
    max_context = (gpus * free - fixed cache) / cache bytes per token."""
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    if context is not None and context < 1:
        raise ValueError(f"context must be at least 1 token, got {context}")
    by_format = weight_bytes(spec)
    weights = sum(by_format.values())
    ws = expert_workspace_bytes(spec, gpus, workspace)
    free = gpu_mem_gib * GIB - weights / gpus - ws - activation_reserve_gib * GIB
    per_token, fixed = cache_totals(spec, kv_dtype)
    max_ctx, ctx_gib, fits = context_fit(gpus * free, per_token, fixed, spec.context.max_position_embeddings, context)
    return MemoryPlan(
        gpus=gpus,
        gpu_mem_gib=gpu_mem_gib,
        kv_dtype=kv_dtype,
        weights_gib=weights / GIB,
        weights_gib_per_gpu=weights / gpus / GIB,
        weights_gib_by_format={k: v / GIB for k, v in by_format.items()},
        expert_workspace_gib_per_gpu=ws / GIB,
        activation_reserve_gib_per_gpu=activation_reserve_gib,
        free_for_cache_gib_per_gpu=free / GIB,
        cache_bytes_per_token=per_token,
        cache_fixed_gib=fixed / GIB,
        kda_state_gib_per_request=kda_state_bytes(spec) / GIB,
        max_context_tokens=max_ctx,
        context_limit=min(max_ctx, spec.context.max_position_embeddings),
        workspace_policy={"max_tokens_per_step": workspace.max_tokens_per_step, "buffers": workspace.buffers,
                          "format": "fp8", "fp8_block": list(workspace.fp8_block)},
        context=context,
        context_cache_gib=ctx_gib,
        context_fits=fits,
    )
