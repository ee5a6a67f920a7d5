"""What one rank of a tensor x expert parallel job holds: its weight bytes by category, from the ModelSpec
alone, tensor by tensor as the model files allocate them (dayzero/models/*.py) and split as they split
(docs/parallel.md: dayzero/models/sharded.py's ColumnLinear / RowLinear / VocabEmbedding / ExpertShard).

Categories (CATEGORIES):
    attention    q / k / v / o projections and per-head tensors (sinks, KDA's A_log, dt_bias, convolutions,
                 gates), split over tp; the parts every rank holds whole: MLA's q_a / kv_a down projections
                 and their norms, DSA's indexer, DeepSeek-V4's wq_a, shared key-value wkv, compressors and
                 indexer, KDA's low-rank f_a / g_a and o_norm
    experts      routed experts, over ep (biases and scales included)
    mlp          dense MLPs and shared experts over tp (DeepSeek-V4's shared experts whole); Kimi K3's
                 latent projections (routed_expert_down / up, norm) whole
    vocabulary   embedding and lm_head rows, over tp
    other        layer norms, routers (DeepSeek-V4's hash table too), hyper-connections, attention-residual
                 mixers: whole
    derived      tensors made at load from the weights (non-persistent buffers): MLA's absorbed w_uk / w_uv
                 (a copy of the rank's kv_b_proj rows in the model dtype), DeepSeek-V4's unit query-norm weight
`RankWeights.split` holds each category's bytes of tensors divided over tp or ep (this rank's share),
`.whole` those every rank holds in full.

Counted as the model holds them, not as transformers counts parameters (dayzero.plan does that): float
tensors in the model dtype except where the model file keeps float32 (routers of DeepSeek-V3 and Kimi,
gpt-oss and DeepSeek-V4 sinks, hyper-connections, compressor position biases, KDA's A_log / dt_bias,
V3.2's indexer weights_proj); FP8 block-scaled matrices as e4m3 plus their scale grid (ceil of each side
over the 128 block, of the rank's share; DeepSeek-V3 family scales float32 as it holds them, V4 ue8m0
scales one byte); MXFP4 as packed bytes plus one E8M0 byte per 32. The vision tower is not loaded
(text prompts), so not counted. Kimi K3's split (its latent MoE, MXFP4 experts, gated MLA) follows Kimi
Linear's rules; docs/parallel.md says what the model file does today.

Invalid splits raise the ValueError the model would: a count that does not divide (dayzero.parallel.state's
message naming the field and the flag), or an FP8 share that is not whole blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from dayzero.parallel.state import Parallel
from dayzero.spec import AttentionSpec, ExpertsSpec, ModelSpec

CATEGORIES = ("attention", "experts", "mlp", "vocabulary", "other", "derived")
MXFP4_GROUP = 32  # values per E8M0 scale byte; two E2M1 values per byte
F32, U8, I64 = 4, 1, 8  # bytes per element of float32, uint8 / e4m3, int64


@dataclass(frozen=True)
class RankWeights:
    """Bytes one rank holds by category: split (its share of divided tensors) and whole (held in full)."""

    split: dict[str, int]
    whole: dict[str, int]

    def bytes(self, category: str) -> int:
        return self.split[category] + self.whole[category]

    @property
    def loaded(self) -> int:
        """Bytes of the tensors filled from the checkpoint (parameters and persistent buffers)."""
        return sum(self.bytes(c) for c in CATEGORIES if c != "derived")

    @property
    def total(self) -> int:
        return self.loaded + self.bytes("derived")

    def to_dict(self) -> dict:
        return {c: {"bytes": self.bytes(c), "whole_bytes": self.whole[c]} for c in CATEGORIES}


@dataclass(frozen=True)
class _Dense:
    """How a family stores its dense projections: fmt bf16 | fp8 (block-scaled), scale bytes per block."""

    fmt: str = "bf16"
    block: tuple[int, int] = (128, 128)
    scale_bytes: int = F32


BF16 = _Dense()


@dataclass
class _Tally:
    """Adds up one rank's tensors; `item` is the model dtype's element size."""

    p: Parallel
    item: int
    experts_field: str = "n_routed_experts"  # the config field of the routed-expert count, for errors
    split: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    whole: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))

    def add(self, category: str, nbytes: int, split: bool = False) -> None:
        (self.split if split else self.whole)[category] += nbytes

    def share(self, n: int, what: str) -> int:
        start, stop = self.p.split(n, what)
        return stop - start

    def vector(self, category: str, n: int, item: int | None = None, split: str | None = None, width: int = 1) -> None:
        """A tensor [n, width] (item bytes each, default the model dtype), its n rows (heads, vocabulary
        entries) split over tp when `split` names what is split."""
        n = self.share(n, split) if split else n
        self.add(category, n * width * (item or self.item), split is not None)

    def linear(self, category: str, out: int, n_in: int, dense: _Dense = BF16, split: str | None = None,
               bias: bool = False, name: str = "projection") -> None:
        """A Linear [out, n_in] (models.layers.Linear; split "column" / "row" as sharded.ColumnLinear /
        RowLinear, whose bias is split with the rows or held whole)."""
        if split == "column":
            out = self._fp8_share(out, dense, 0, f"{name}: out_features")
        elif split == "row":
            n_in = self._fp8_share(n_in, dense, 1, f"{name}: in_features")
        nbytes = out * n_in * self.item
        if dense.fmt == "fp8":
            nbytes = out * n_in + math.ceil(out / dense.block[0]) * math.ceil(n_in / dense.block[1]) * dense.scale_bytes
        self.add(category, nbytes, split is not None)
        if bias:
            self.add(category, out * self.item, split == "column")

    def _fp8_share(self, n: int, dense: _Dense, dim: int, what: str) -> int:
        local = self.share(n, what)
        if self.p.tp_size > 1 and dense.fmt == "fp8" and local % dense.block[dim]:
            raise ValueError(f"{what}: a rank's {local} {'rows' if dim == 0 else 'columns'} are not whole FP8 scale "
                             f"blocks of {dense.block[dim]}; choose a --tp that keeps them whole")
        return local

    def experts(self, num: int, per_expert: int) -> None:
        if num % self.p.ep_size:  # the model's own message names DeepSeek's field whatever the family
            raise ValueError(f"{self.experts_field} = {num} does not split over expert-parallel size "
                             f"{self.p.ep_size}; choose a --ep that divides it")
        start, stop = self.p.split_experts(num)
        self.add("experts", (stop - start) * per_expert, split=True)


def _mxfp4_matrix(n: int, k: int) -> int:
    """An MXFP4 matrix [n, k]: blocks uint8 [n, k/32, 16] and E8M0 scale bytes [n, k/32]."""
    return n * (k // MXFP4_GROUP) * (MXFP4_GROUP // 2 + 1)


# -- attention, one function a kind ---------------------------------------------------------------


def _gqa(t: _Tally, a: AttentionSpec, hidden: int) -> None:
    """gpt-oss, GLM-4.x, Qwen3.5: q / k / v by output rows, o_proj by columns (its bias whole), float32 sinks by
    head; q_norm / k_norm [head_dim] whole (Qwen3.5's zero-centred ones also derive float32 1 + weight)."""
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    gated = 2 if a.output_gate == "sigmoid" else 1  # Qwen3.5's q_proj also gives the output gate
    for name, rows in (("q_proj", gated * q), ("k_proj", kv), ("v_proj", kv)):
        t.linear("attention", rows, hidden, split="column", bias=a.bias or a.qkv_bias, name=name)
    t.linear("attention", hidden, q, split="row", bias=a.bias, name="o_proj")
    if a.sinks:
        t.vector("attention", a.num_heads, F32, split="num_attention_heads")
    if a.qk_norm:
        t.vector("attention", 2 * a.head_dim)
    if a.qk_norm and a.output_gate == "sigmoid":
        t.vector("derived", 2 * a.head_dim, F32)


def _mla(t: _Tally, a: AttentionSpec, hidden: int, dense: _Dense) -> None:
    """DeepSeek-V3 / V3.2 / Kimi MLA: q (or q_b), kv_b by heads, o by columns; the down projections, their
    norms and DSA's indexer whole; w_uk / w_uv derived from the rank's kv_b rows at load."""
    heads = a.num_heads
    t.share(heads, "num_attention_heads")
    if a.q_lora_rank is None:
        t.linear("attention", heads * a.head_dim, hidden, dense, "column", name="q_proj")
    else:
        t.linear("attention", a.q_lora_rank, hidden, dense, bias=a.bias)  # q_a_proj
        t.vector("attention", a.q_lora_rank)  # q_a_layernorm
        t.linear("attention", heads * a.head_dim, a.q_lora_rank, dense, "column", name="q_b_proj")
    t.linear("attention", a.kv_lora_rank + a.qk_rope_head_dim, hidden, dense, bias=a.bias)  # kv_a_proj_with_mqa
    t.vector("attention", a.kv_lora_rank)  # kv_a_layernorm
    kv_b = heads * (a.qk_nope_head_dim + a.v_head_dim)
    t.linear("attention", kv_b, a.kv_lora_rank, dense, "column", name="kv_b_proj")
    t.linear("attention", hidden, heads * a.v_head_dim, dense, "row", bias=a.bias, name="o_proj")
    if a.output_gate == "sigmoid":  # Kimi K3's gated MLA: g_proj by heads, as q
        t.linear("attention", heads * a.v_head_dim, hidden, split="column", bias=a.bias, name="g_proj")
    if a.kind == "dsa":  # the lightning indexer: wq_b, wk, LayerNorm k_norm, float32 weights_proj
        t.linear("attention", a.index_n_heads * a.index_head_dim, a.q_lora_rank, dense)
        t.linear("attention", a.index_head_dim, hidden, dense)
        t.vector("attention", 2 * a.index_head_dim)
        t.vector("attention", a.index_n_heads * hidden, F32)
    t.add("derived", t.share(kv_b, "kv_b_proj: out_features") * a.kv_lora_rank * t.item, split=True)


def _compressor(t: _Tally, hidden: int, dim: int, ratio: int, overlap: bool) -> None:
    width = 2 * dim if overlap else dim
    t.vector("attention", 2 * width * hidden)  # wkv, wgate (bf16 Linears)
    t.vector("attention", dim)  # norm
    t.vector("attention", ratio * width, F32)  # ape


def _v4(t: _Tally, a: AttentionSpec, hidden: int, dense: _Dense) -> None:
    """DeepSeek-V4: wq_b by heads, wo_a by whole groups, wo_b by columns, float32 sinks by head; wq_a,
    the shared key-value wkv, compressors and the CSA indexer whole."""
    heads, hd = a.num_heads, a.head_dim
    t.share(a.o_groups, "o_groups")
    t.linear("attention", a.q_lora_rank, hidden, dense)  # wq_a
    t.vector("attention", a.q_lora_rank)  # q_norm
    t.linear("attention", heads * hd, a.q_lora_rank, dense, "column", name="wq_b")
    t.linear("attention", hd, hidden, dense)  # wkv
    t.vector("attention", hd)  # kv_norm
    t.linear("attention", a.o_groups * a.o_lora_rank, heads * hd // a.o_groups, dense, "column",
             name="wo_a (o_groups x o_lora_rank)")
    t.linear("attention", hidden, a.o_groups * a.o_lora_rank, dense, "row", name="wo_b")
    t.vector("attention", heads, F32, split="num_attention_heads")  # attn_sink
    t.vector("derived", hd)  # unit_weight
    if a.kind in ("csa", "hca"):
        _compressor(t, hidden, hd, a.compress_ratio, a.kind == "csa")
    if a.kind == "csa":  # indexer: wq_b, bf16 weights_proj, its own overlapping compressor
        t.linear("attention", a.index_n_heads * a.index_head_dim, a.q_lora_rank, dense)
        t.vector("attention", a.index_n_heads * hidden)
        _compressor(t, hidden, a.index_head_dim, a.compress_ratio, True)


def _kda(t: _Tally, a: AttentionSpec, hidden: int) -> None:
    """Kimi delta attention: every per-head tensor by head (q / k / v, convolutions, f_b, b, g or g_b,
    A_log, dt_bias, o_proj's columns); f_a, g_a and o_norm whole."""
    heads, d = a.num_heads, a.head_dim
    width, local = heads * d, t.share(heads, "linear_attn_config.num_heads") * d
    for name in ("q_proj", "k_proj", "v_proj"):
        t.linear("attention", width, hidden, split="column", name=name)
    t.add("attention", 3 * local * a.conv_kernel * t.item, split=True)  # {q,k,v}_conv1d [local, 1, K]
    t.add("attention", (local // d + local) * F32, split=True)  # A_log [heads], dt_bias [channels], float32
    t.linear("attention", d, hidden)  # f_a_proj
    t.linear("attention", width, d, split="column", name="f_b_proj")
    t.linear("attention", heads, hidden, split="column", name="b_proj")
    if a.output_gate == "full_rank":
        t.linear("attention", width, hidden, split="column", name="g_proj")
    else:
        t.linear("attention", d, hidden)  # g_a_proj
        t.linear("attention", width, d, split="column", name="g_b_proj")
    t.vector("attention", d)  # o_norm
    t.linear("attention", hidden, width, split="row", name="o_proj")


def _gdn(t: _Tally, a: AttentionSpec, hidden: int) -> None:
    """Gated DeltaNet: in_proj_{qkv,z,b,a} by output rows, out_proj by columns; the convolution [C, 1, K]
    by channel; A_log, dt_bias float32 by value head; the gated norm [dv] whole."""
    qk, v = a.num_kv_heads * a.head_dim, a.num_heads * a.v_head_dim
    t.linear("attention", 2 * qk + v, hidden, split="column", name="in_proj_qkv")
    t.linear("attention", v, hidden, split="column", name="in_proj_z")
    for name in ("in_proj_b", "in_proj_a"):
        t.linear("attention", a.num_heads, hidden, split="column", name=name)
    t.vector("attention", 2 * qk + v, split="in_proj_qkv: out_features", width=a.conv_kernel)
    t.vector("attention", 2 * a.num_heads, F32, split="linear_num_value_heads")
    t.vector("attention", a.v_head_dim)
    t.linear("attention", hidden, v, split="row", name="out_proj")


# -- MLPs ------------------------------------------------------------------------------------------


def _swiglu(t: _Tally, hidden: int, inter: int, dense: _Dense, split: bool = True) -> None:
    """gate / up [inter, hidden] by rows, down [hidden, inter] by columns (or all whole)."""
    for name in ("gate_proj", "up_proj"):
        t.linear("mlp", inter, hidden, dense, "column" if split else None, name=name)
    t.linear("mlp", hidden, inter, dense, "row" if split else None, name="down_proj")


def _routed_bytes(e: ExpertsSpec, item: int, dense: _Dense = BF16) -> int:
    """One routed expert's w13 [2I, K] and w2 [K, I] as the family's experts module holds them."""
    i, k = e.intermediate_size, e.input_dim
    if e.format == "mxfp4":
        return _mxfp4_matrix(2 * i, k) + _mxfp4_matrix(k, i)
    if e.format == "fp8":
        b0, b1 = dense.block
        scales = math.ceil(2 * i / b0) * math.ceil(k / b1) + math.ceil(k / b0) * math.ceil(i / b1)
        return 3 * i * k + scales * dense.scale_bytes
    return 3 * i * k * item


def _biased_router(t: _Tally, e: ExpertsSpec, hidden: int) -> None:
    t.vector("other", e.num * hidden + e.num, F32)  # gate.weight, e_score_correction_bias (float32)


# -- families --------------------------------------------------------------------------------------


def _vocabulary(t: _Tally, spec: ModelSpec, tied: bool) -> None:
    t.vector("vocabulary", spec.vocab_size, split="vocab_size", width=spec.hidden_size)  # embedding rows
    if not tied:
        t.linear("vocabulary", spec.vocab_size, spec.hidden_size, split="column", name="lm_head (vocab_size)")


def _gpt_oss(t: _Tally, spec: ModelSpec) -> None:
    hidden, e = spec.hidden_size, spec.experts
    for layer in spec.layers:
        _gqa(t, layer.attention, hidden)
        t.linear("other", e.num, hidden, bias=True)  # router
        i = e.intermediate_size
        biases = (2 * i + hidden) * t.item  # b13, b2
        t.experts(e.num, (_mxfp4_matrix(2 * i, hidden) + _mxfp4_matrix(hidden, i) if e.format == "mxfp4"
                          else 3 * i * hidden * t.item) + biases)


def _deepseek_v3(t: _Tally, spec: ModelSpec) -> None:
    dense = _Dense(spec.quant.dense_format, tuple(spec.quant.fp8_block or (128, 128)))
    hidden, e = spec.hidden_size, spec.experts
    for layer in spec.layers:
        if layer.attention.kind == "gqa":  # GLM-4.x: DeepSeek-V3's MLPs beside grouped-query attention
            _gqa(t, layer.attention, hidden)
        else:
            _mla(t, layer.attention, hidden, dense)
        if layer.mlp.kind == "dense":
            _swiglu(t, hidden, layer.mlp.intermediate_size, dense)
            continue
        _biased_router(t, e, hidden)
        t.experts(e.num, _routed_bytes(e, t.item, _Dense(e.format)))
        if e.num_shared:
            _swiglu(t, hidden, e.shared_intermediate_size, dense)


def _deepseek_v4(t: _Tally, spec: ModelSpec) -> None:
    q = spec.quant
    dense = _Dense(q.dense_format, tuple(q.fp8_block or (128, 128)), 1 if q.scale_fmt == "ue8m0" else F32)
    hidden, n = spec.hidden_size, spec.cross_layer.hc_mult
    for layer in spec.layers:
        _v4(t, layer.attention, hidden, dense)
        t.vector("other", 2 * (((2 + n) * n) * n * hidden + (2 + n) * n + 3), F32)  # hc_{attn,ffn}_{fn,base,scale}
        e = layer.mlp.experts
        t.vector("other", e.num * hidden)  # gate.weight
        if layer.mlp.kind == "hash_moe":
            t.vector("other", spec.vocab_size * e.top_k, I64)  # tid2eid
        else:
            t.vector("other", e.num, F32)  # gate.bias
        t.experts(e.num, _routed_bytes(e, t.item, dense))
        _swiglu(t, hidden, e.shared_intermediate_size, dense, split=False)  # shared w1, w3, w2: whole
    t.vector("other", n * n * hidden + n + 1, F32)  # hc_head_{fn,base,scale}


def _kimi_linear(t: _Tally, spec: ModelSpec) -> None:
    hidden, e = spec.hidden_size, spec.experts
    for layer in spec.layers:
        if layer.attention.kind == "kda":
            _kda(t, layer.attention, hidden)
        else:
            _mla(t, layer.attention, hidden, BF16)
        if layer.cross_layer == "attention_residual":
            t.vector("other", 4 * hidden)  # self_attention_res and mlp_res: norm [D], proj [1, D]
        if layer.mlp.kind == "dense":
            _swiglu(t, hidden, layer.mlp.intermediate_size, BF16)
            continue
        _biased_router(t, e, hidden)
        t.experts(e.num, _routed_bytes(e, t.item))
        if e.latent_dim:  # routed_expert_down_proj, (routed_expert_norm,) routed_expert_up_proj
            t.vector("mlp", 2 * hidden * e.latent_dim + (e.latent_dim if e.latent_norm else 0))
        _swiglu(t, hidden, e.shared_intermediate_size, BF16)
    if spec.cross_layer.kind == "attention_residual":
        t.vector("other", 2 * hidden)  # output_attn_res


def _qwen3_5_moe(t: _Tally, spec: ModelSpec) -> None:
    hidden, e = spec.hidden_size, spec.experts
    for layer in spec.layers:
        (_gdn if layer.attention.kind == "gdn" else _gqa)(t, layer.attention, hidden)
        t.vector("other", e.num * hidden)  # gate.weight, in the model dtype
        t.experts(e.num, _routed_bytes(e, t.item))
        _swiglu(t, hidden, e.shared_intermediate_size, BF16)
        t.vector("mlp", hidden)  # shared_expert_gate
        t.vector("derived", 2 * hidden, F32)  # the zero-centred norms' 1 + weight
    t.vector("derived", hidden, F32)


EXPERTS_FIELD = {"gpt_oss": "num_local_experts", "kimi_linear": "num_experts", "qwen3_5_moe_text": "num_experts"}
FAMILIES = {"gpt_oss": _gpt_oss, "deepseek_v3": _deepseek_v3, "kimi_k2": _deepseek_v3, "deepseek_v32": _deepseek_v3,
            "deepseek_v4": _deepseek_v4, "kimi_linear": _kimi_linear, "glm4_moe": _deepseek_v3,
            "qwen3_5_moe_text": _qwen3_5_moe}


def rank_weights(spec: ModelSpec, p: Parallel, dtype: torch.dtype = torch.bfloat16) -> RankWeights:
    """The weight bytes rank p holds of a model of this spec computing in `dtype` (ValueError: the split
    is not one the model can make)."""
    family = FAMILIES.get(spec.text_model_type)
    if family is None:
        raise ValueError(f"no per-rank weight rules for {spec.text_model_type!r}; known: {', '.join(FAMILIES)}")
    t = _Tally(p, dtype.itemsize, EXPERTS_FIELD.get(spec.text_model_type, "n_routed_experts"))
    _vocabulary(t, spec, spec.tie_word_embeddings and spec.text_model_type != "deepseek_v4")
    for _ in spec.layers:
        t.vector("other", 2 * spec.hidden_size)  # the layer's two norms
    t.vector("other", spec.hidden_size)  # final norm
    family(t, spec)
    return RankWeights(dict(t.split), dict(t.whole))
