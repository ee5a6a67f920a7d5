"""DeepSeek-V4 (model_type deepseek_v4), in DeepSeek's original on-disk naming (no `model.` prefix).

Per layer (paper: DeepSeek-V4 technical report; transformers' modeling_deepseek_v4.py is the oracle):
  hc_mult residual streams --hyper_connection--> x --attn_norm--> attention --hyper_connection_post-->
  streams --hyper_connection--> x --ffn_norm--> MoE --hyper_connection_post--> streams
Attention: low-rank queries (wq_a, q_norm, wq_b, per-head RMSNorm), one shared key=value head (wkv,
kv_norm), partial interleaved RoPE on the last qk_rope_head_dim channels, a sliding window plus
compressed entries (compress_ratios[i]: 0 window only, 4 CSA with the lightning indexer, 128 HCA),
per-head sinks, inverse RoPE on the output's rope channels, grouped low-rank output (wo_a per group
of heads, then wo_b). Window-only layers use RoPE with rope_theta; compressed layers use YaRN with
compress_rope_theta (no cos/sin scaling), for queries, keys and compressed entries alike.
MoE: sqrt(softplus) router (hash table tid2eid in the first num_hash_layers layers), routed experts
(MXFP4 / FP8 / bf16) with the swiglu clamp, plus one shared expert with the same clamp.
The final hyper-head collapses the streams before `norm` and `head`.

Cache per layer (`cache.layers[i]`): stream "window" (rotated keys, windowed: the last
sliding_window - 1 are kept); per compressor (attention "comp_", indexer "index_"): stream "entries"
(one compressed entry per ratio tokens) and states "pending_kv"/"pending_gate" [ratio, C] (the
unfinished window's projected tokens, position % ratio of them valid) and for CSA "prev_kv"/"prev_gate"
[ratio, C] (the last complete window: its Ca half overlaps the next entry; gate -inf before one
exists), per sequence.

The packed step runs attention on [B, T] blocks (`_GroupCache`): consecutive sequences that compute
the same number of tokens from the same position (prefill chunks), or one token each (decodes, in
whatever phase of their compression windows: each row compresses a candidate entry, visible and
written only where its window completes), and are all fresh or all not. A block writes its entries
first and reads the streams in place, one row a token (ops.paged_v4_index_topk, ops.paged_v4_attention);
only the layout probe's one token runs the gathered ops (on the entries it just made).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dayzero import ops
from dayzero.formats import mxfp4
from dayzero.models import register_model
from dayzero.models.base import CausalLM, WeightTarget, collect_weight_targets, copy_target, empty_param
from dayzero.weights.values import SCALES
from dayzero.models.layers import Linear, RMSNorm
from dayzero.models.sharded import (ColumnLinear, ExpertShard, RowLinear, VocabEmbedding, other_ranks_experts,
                                    shard_target)
from dayzero.parallel.state import current
from dayzero.models.rotary import Rope, rope_from_config
from dayzero.ops.moe import MOE_EXPERT_OPS, Activation, ExpertWeights
from dayzero.spec import LayerSpec, ModelSpec
from dayzero.weights import Chunk, Layout, Rename, TensorSpec, Unstack

FP4_BLOCK = 32  # values per E8M0 scale along K

# Tensor layouts (dayzero.weights.layouts), each mapped onto the release names above.
# transformers' save_pretrained writes the release names under `model.`, except the embedding,
# the hyper-head and the final norm; its in-memory names (save_original_format=False) are its
# module tree: self_attn / mlp, q_a_proj ..., attn_hc.fn, the CSA indexer inside the compressor,
# routed experts stacked as gate_up_proj [E, 2I, H] (w1 rows, then w3) and down_proj [E, H, I].
# Its FP8 quantizer names block scales `weight_scale_inv`, the release `scale`. (Its load renames
# every `.norm.` to `.kv_norm.`, so its save turns the release's `attn.kv_norm` into `attn.norm`.)
_TRANSFORMERS_TOP = (
    Rename(r"\.attn\.norm\.weight$", ".attn.kv_norm.weight"),
    Rename(r"^model\.embed_tokens\.", "embed."),
    Rename(r"^model\.hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    Rename(r"^model\.", ""),
    Rename(r"^lm_head\.", "head."),
    Rename(r"\.weight_scale_inv$", ".scale"),
)
LAYOUTS = (
    Layout("release", "embed.weight, layers.N.attn.wq_a.weight, hc_head_fn"),
    Layout("transformers", "model.embed_tokens.weight, model.layers.N.attn.wq_a.weight, model.hc_head.hc_fn",
           _TRANSFORMERS_TOP),
    Layout("transformers in-memory", "model.layers.N.self_attn.q_a_proj.weight, model.layers.N.attn_hc.fn", (
        *_TRANSFORMERS_TOP,
        Rename(r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
        Rename(r"\.self_attn\.compressor\.indexer\.scorer\.", ".attn.indexer."),
        Rename(r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
        Rename(r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
        Rename(r"\.self_attn\.", ".attn."),
        Rename(r"\.mlp\.", ".ffn."),
        Rename(r"\.input_layernorm\.", ".attn_norm."),
        Rename(r"\.post_attention_layernorm\.", ".ffn_norm."),
        Rename(r"\.sinks$", ".attn_sink"),
        Rename(r"\.q_a_norm\.", ".q_norm."),
        Rename(r"\.compressor\.kv_norm\.", ".compressor.norm."),
        Rename(r"\.position_bias$", ".ape"),
        Rename(r"\.compressor\.gate_proj\.", ".compressor.wgate."),
        Rename(r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
        Rename(r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
        Rename(r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
        *(Rename(rf"\.{ours}\.", f".{theirs}.") for ours, theirs in (
            ("q_a_proj", "wq_a"), ("q_b_proj", "wq_b"), ("kv_proj", "wkv"), ("o_a_proj", "wo_a"), ("o_b_proj", "wo_b"))),
        Rename(r"\.gate\.e_score_correction_bias$", ".gate.bias"),
        Unstack(r"\.experts\.(gate_up_proj|down_proj)(_scale_inv|_scale)?$", r".experts.{i}.\1\2"),
        Chunk(r"\.experts\.(\d+)\.gate_up_proj(_scale_inv|_scale)?$", (r".experts.\1.w1.weight\2", r".experts.\1.w3.weight\2")),
        Rename(r"\.experts\.(\d+)\.down_proj(_scale_inv|_scale)?$", r".experts.\1.w2.weight\2"),
        Rename(r"\.weight_scale(_inv)?$", ".scale"),
    )),
)


class LinearFactory:
    """Builds the dense projections in the checkpoint's format (FP8 blocks with `.scale`, or bf16)."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device):
        self.fmt = spec.quant.dense_format
        self.block = tuple(spec.quant.fp8_block or (128, 128))
        self.scale_dtype = torch.float8_e8m0fnu if spec.quant.scale_fmt == "ue8m0" else torch.float32
        self.dtype, self.device = dtype, device

    def __call__(self, in_features: int, out_features: int, *, quantized: bool = True, cls: type = Linear, **kw) -> Linear:
        fmt = self.fmt if quantized else "bf16"
        return cls(in_features, out_features, fmt=fmt, dtype=self.dtype, device=self.device, block=self.block,
                   scale_name="scale", scale_dtype=self.scale_dtype, **kw)


class GroupedLinear(Linear):
    """wo_a: `groups` independent projections, group g maps input group g [.., in/groups] with weight
    rows [g*out_g, (g+1)*out_g); stored as one [groups*out_g, in/groups] matrix."""

    def __init__(self, in_per_group: int, out_features: int, *, groups: int, **kw):
        super().__init__(in_per_group, out_features, **kw)
        self.groups = groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., groups, in_per_group] -> [..., out_features] (group-major)."""
        rows = self.out_features // self.groups
        outs = []
        for g in range(self.groups):
            weight = self.weight[g * rows:(g + 1) * rows]
            if self.fmt == "fp8":
                scale = getattr(self, self.scale_name)[g * rows // self.block[0]:(g + 1) * rows // self.block[0]]
                outs.append(ops.linear_fp8_block(x[..., g, :], weight, scale, None, self.block))
            else:
                outs.append(ops.linear(x[..., g, :], weight))
        return torch.cat(outs, dim=-1)


class GroupedColumnLinear(ColumnLinear, GroupedLinear):
    """wo_a split over tensor-parallel ranks by whole groups: a rank holds groups [r G / tp, (r + 1) G / tp)
    (their rows), which read its heads' outputs (the heads of group g are g's H / G consecutive heads)."""


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on the last 2 * cos.shape[-1] channels of x [B, T, ..., D]; cos/sin
    [B, T, r/2] or [T, r/2] (broadcast over the batch)."""
    b, t = x.shape[:2]
    rot = 2 * cos.shape[-1]
    cos, sin = cos.expand(b, t, -1).reshape(b * t, -1), sin.expand(b, t, -1).reshape(b * t, -1)
    tail = ops.rope(x[..., -rot:].reshape(b * t, *x.shape[2:-1], rot), cos, sin, interleaved=True)
    return torch.cat([x[..., :-rot], tail.view(*x.shape[:-1], rot)], dim=-1)


class Compressor(nn.Module):
    """Pools every `ratio` tokens into one entry of width `dim` (CSA: two overlapping series)."""

    def __init__(self, hidden: int, dim: int, ratio: int, overlap: bool, eps: float, dtype, device):
        super().__init__()
        self.dim, self.ratio, self.overlap, self.eps = dim, ratio, overlap, eps
        width = 2 * dim if overlap else dim
        self.wkv = Linear(hidden, width, dtype=dtype, device=device)
        self.wgate = Linear(hidden, width, dtype=dtype, device=device)
        self.norm = RMSNorm(dim, eps, dtype=dtype, device=device)
        self.ape = empty_param((ratio, width), torch.float32, device)

    def forward(self, x: torch.Tensor, rope: Rope, state: dict, key: str, positions: torch.Tensor) -> torch.Tensor:
        """Feed x [B, T, hidden] at positions [B, T]; returns every entry so far, rotated at its
        window's first position. State: "pending_kv"/"pending_gate" [B, ratio, C] whose first
        p % ratio rows are the unfinished window's tokens; for CSA "prev_kv"/"prev_gate" [B, ratio, C],
        the last complete window (zeros with gate -inf, i.e. weight 0, before the first one).
        One token per row may sit at different positions per row (a batched decode step); several
        tokens per call need rows that start together."""
        kv, gate = self.wkv(x), self.wgate(x)
        b, t = x.shape[:2]
        pending_kv, pending_gate = state.get(key + "pending_kv"), state.get(key + "pending_gate")
        if pending_kv is None:  # nothing before these tokens
            pending_kv = kv.new_zeros((b, self.ratio, kv.shape[-1]))
            pending_gate = torch.zeros_like(pending_kv)
        prev = None
        if self.overlap:
            prev = (state.get(key + "prev_kv"), state.get(key + "prev_gate"))
            if prev[0] is None:
                prev = (kv.new_zeros((b, self.ratio, kv.shape[-1])), kv.new_full((b, self.ratio, kv.shape[-1]), float("-inf")))
        if t == 1:
            new, pending_kv, pending_gate, prev = self._one_token(kv, gate, pending_kv, pending_gate, prev, positions[:, 0], rope)
        else:
            if b > 1 and bool((positions[:, 0] != positions[0, 0]).any()):
                raise ValueError("Compressor: rows of several tokens must start at the same position")
            start = int(positions[0, 0])
            count, first = start % self.ratio, start // self.ratio  # pending tokens, entries before this call
            kv = torch.cat([pending_kv[:, :count], kv], dim=1)
            gate = torch.cat([pending_gate[:, :count], gate], dim=1)
            usable = kv.shape[1] // self.ratio * self.ratio
            pending_kv, pending_gate = _padded(kv[:, usable:], self.ratio), _padded(gate[:, usable:], self.ratio)
            new = kv.new_zeros((b, 0, self.dim))
            if usable:
                new = ops.kv_compressor(kv[:, :usable], gate[:, :usable], self.ape, self.norm.weight, self.eps,
                                        self.overlap, *(prev or (None, None)))
                cos, sin = rope.cos_sin(torch.arange(first, first + new.shape[1], device=x.device) * self.ratio)
                new = rope_tail(new, cos, sin)
                if self.overlap:
                    prev = (kv[:, usable - self.ratio:usable], gate[:, usable - self.ratio:usable])
        state[key + "pending_kv"], state[key + "pending_gate"] = pending_kv, pending_gate
        if self.overlap:
            state[key + "prev_kv"], state[key + "prev_gate"] = prev
        return state.append(key + "entries", new, rate=self.ratio)

    def _one_token(self, kv, gate, pending_kv, pending_gate, prev, starts, rope):
        """One token per row at positions `starts` [B]: it joins its row's pending window, and every row
        compresses its window as it stands into a candidate entry [B, 1, dim]. Where the token completes
        the window the candidate is the row's next entry (its window state restarts, and for CSA the
        window becomes prev); elsewhere it is finite, not yet visible to the row's query ((p + 1) //
        ratio entries are), and not written (`_BlockView.append`). No row is ever split off by phase."""
        b = kv.shape[0]
        rows = torch.arange(b, device=kv.device)
        slot = starts % self.ratio
        pending_kv, pending_gate = pending_kv.clone(), pending_gate.clone()
        pending_kv[rows, slot], pending_gate[rows, slot] = kv[:, 0], gate[:, 0]
        completes = (slot == self.ratio - 1).view(b, 1, 1)
        new = ops.kv_compressor(pending_kv, pending_gate, self.ape, self.norm.weight, self.eps, self.overlap,
                                *(prev or (None, None)))
        cos, sin = rope.cos_sin(starts // self.ratio * self.ratio)
        new = rope_tail(new, cos[:, None], sin[:, None])
        if self.overlap:
            prev = (torch.where(completes, pending_kv, prev[0]), torch.where(completes, pending_gate, prev[1]))
        return new, pending_kv.masked_fill(completes, 0), pending_gate.masked_fill(completes, 0), prev


def _padded(x: torch.Tensor, length: int) -> torch.Tensor:
    """x [B, n <= length, C] zero-padded to [B, length, C]."""
    return torch.cat([x, x.new_zeros((x.shape[0], length - x.shape[1], x.shape[2]))], dim=1)


class Indexer(nn.Module):
    """Lightning indexer of a CSA layer: its own compressor at index_head_dim, queries from the
    attention's low-rank query latent, per-head weights from the layer input."""

    def __init__(self, hidden: int, q_lora: int, heads: int, dim: int, topk: int, ratio: int, eps: float,
                 linear: LinearFactory, dtype, device):
        super().__init__()
        self.heads, self.dim, self.topk, self.ratio = heads, dim, topk, ratio
        self.wq_b = linear(q_lora, heads * dim)
        self.weights_proj = linear(hidden, heads, quantized=False)
        self.compressor = Compressor(hidden, dim, ratio, True, eps, dtype, device)

    def forward(self, x, q_latent, positions, cos, sin, rope: Rope, state: dict) -> torch.Tensor:
        """Top-k entry indices [B, T, min(topk, N)] into the block's compressed rows (ops.v4_index_topk)."""
        keys = self.compressor(x, rope, state, "index_", positions)
        q = rope_tail(self.wq_b(q_latent).unflatten(-1, (self.heads, self.dim)), cos, sin)
        if state.paged:  # entry numbers over the stream in place, one row a token
            b, t = positions.shape
            return ops.paged_v4_index_topk(q.flatten(0, 1).contiguous(), keys, self.weights_proj(x).flatten(0, 1),
                                           positions.flatten(), self.ratio, self.topk,
                                           state.rows_seq(t, x.device)).view(b, t, -1)
        return ops.v4_index_topk(q, keys, self.weights_proj(x), positions, self.ratio, self.topk)  # the probe's


class Attention(nn.Module):
    def __init__(self, hidden: int, layer: LayerSpec, linear: LinearFactory, eps: float, dtype, device):
        super().__init__()
        a = layer.attention
        p = current()  # a tensor-parallel rank holds its share of the heads (wq_b rows, wo_a groups, wo_b
        # columns, the sinks); the shared key-value, the compressor and the indexer are whole on every rank
        self.head_range = p.split(a.num_heads, "num_attention_heads")
        p.split(a.o_groups, "o_groups")
        self.heads, self.head_dim, self.window = a.num_heads // p.tp_size, a.head_dim, a.sliding_window
        self.full_heads = a.num_heads
        self.kind, self.ratio = a.kind, a.compress_ratio
        self.wq_a = linear(hidden, a.q_lora_rank)
        self.q_norm = RMSNorm(a.q_lora_rank, eps, dtype=dtype, device=device)
        self.wq_b = linear(a.q_lora_rank, a.num_heads * a.head_dim, cls=ColumnLinear, name="wq_b")
        self.wkv = linear(hidden, a.head_dim)
        self.kv_norm = RMSNorm(a.head_dim, eps, dtype=dtype, device=device)
        self.wo_a = linear(a.num_heads * a.head_dim // a.o_groups, a.o_groups * a.o_lora_rank, cls=GroupedColumnLinear,
                           groups=a.o_groups // p.tp_size, name="wo_a (o_groups x o_lora_rank)")
        self.wo_b = linear(a.o_groups * a.o_lora_rank, hidden, cls=RowLinear, name="wo_b")
        self.attn_sink = empty_param((self.heads,), torch.float32, device)
        self.eps = eps  # queries get a weightless RMSNorm per head
        self.register_buffer("unit_weight", torch.ones(a.head_dim, dtype=dtype, device=device), persistent=False)
        if a.kind in ("csa", "hca"):
            self.compressor = Compressor(hidden, a.head_dim, a.compress_ratio, a.kind == "csa", eps, dtype, device)
        if a.kind == "csa":
            self.indexer = Indexer(hidden, a.q_lora_rank, a.index_n_heads, a.index_head_dim, a.index_topk,
                                   a.compress_ratio, eps, linear, dtype, device)

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        targets = collect_weight_targets(self, prefix)
        targets[prefix + "attn_sink"] = shard_target(self.attn_sink, (self.full_heads,), 0, *self.head_range)
        return targets

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: Rope, cache) -> torch.Tensor:
        """x [1, N, hidden], positions [1, N]: the step's packed tokens, run block by block."""
        group_cache = _GroupCache(cache, self.ratio)
        outs = []
        for rows, shape, view in group_cache.groups():
            outs.append(self._attend(x[0, rows].view(*shape, -1), positions[0, rows].view(shape), rope, view).flatten(0, 1))
        group_cache.commit()
        return torch.cat(outs)[None] if len(outs) > 1 else outs[0][None]

    def _attend(self, x: torch.Tensor, positions: torch.Tensor, rope: Rope, state) -> torch.Tensor:
        """x [B, T, hidden] of one block of sequences (module docstring)."""
        cos, sin = rope.cos_sin(positions)
        q_latent = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_latent).unflatten(-1, (self.heads, self.head_dim))
        q = rope_tail(ops.rms_norm(q, self.unit_weight, self.eps), cos, sin)
        kv = rope_tail(self.kv_norm(self.wkv(x)), cos, sin)
        keys = state.append("window", kv, self.window)
        compressed = indices = None
        if self.kind in ("csa", "hca"):
            compressed = self.compressor(x, rope, state, "comp_", positions)
        if self.kind == "csa":
            indices = self.indexer(x, q_latent, positions, cos, sin, rope, state)
        if state.paged:  # the streams read in place (this step's entries written), one row a token
            b, t = positions.shape
            out = ops.paged_v4_attention(q.flatten(0, 1).contiguous(), keys, self.attn_sink, self.head_dim**-0.5,
                                         self.window, positions.flatten(), compressed,
                                         None if indices is None else indices.flatten(0, 1),
                                         self.ratio if compressed is not None else None,
                                         state.rows_seq(t, x.device)).view(q.shape)
        else:
            out = ops.sparse_attention(q, keys, self.attn_sink, self.head_dim**-0.5, self.window, compressed, indices,
                                       positions, self.ratio)  # the layout probe's one token
        out = rope_tail(out, cos, -sin)  # undo the rotation the values (= keys) carried
        return self.wo_b(self.wo_a(out.unflatten(2, (self.wo_a.groups, -1)).flatten(3)))


class Router(nn.Module):
    """ffn.gate: weight [E, hidden]; `bias` (score correction, float32 [E]) or `tid2eid` (hash layers)."""

    def __init__(self, num_experts: int, hidden: int, top_k: int, vocab: int, hashed: bool, dtype, device):
        super().__init__()
        self.hashed, self.top_k = hashed, top_k
        self.weight = empty_param((num_experts, hidden), dtype, device)
        if hashed:
            self.register_buffer("tid2eid", torch.empty((vocab, top_k), dtype=torch.int64, device=device))
        else:
            self.bias = empty_param((num_experts,), torch.float32, device)

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        targets = {prefix + "weight": copy_target(self.weight, prefix + "weight")}
        if self.hashed:  # int32 or int64 table
            table = self.tid2eid
            targets[prefix + "tid2eid"] = WeightTarget(TensorSpec(tuple(table.shape), (torch.int32, torch.int64)),
                                                       lambda t: table.copy_(t))
        else:
            targets[prefix + "bias"] = copy_target(self.bias, prefix + "bias")
        return targets

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        logits = ops.linear(x, self.weight)
        if self.hashed:
            return ops.route_hash(logits, token_ids, self.tid2eid, scaling)
        return ops.route_sqrtsoftplus(logits, self.bias, self.top_k, scaling)


class RoutedExperts(nn.Module):
    """ffn.experts.{e}.w1 (gate) / w3 (up) / w2 (down), held stacked in the canonical layout of
    dayzero.ops.moe: w13 [E, 2I, H] (gate rows first), w2 [E, H, I]. mxfp4: blocks uint8
    [E, N, K/32, 16] and E8M0 scale bytes [E, N, K/32]; fp8: e4m3 with block scales
    [E, N/bn, K/bk]; bf16: model dtype."""

    fp8_workspace = None  # the engine's FP8 expert workspace, passed with the weights (dayzero/engine/llm.py)

    def __init__(self, num: int, inter: int, hidden: int, fmt: str, linear: LinearFactory, dtype, device):
        """num: the model's experts; an expert-parallel rank holds [start, stop) (ExpertShard)."""
        super().__init__()
        self.shard = ExpertShard(num)
        num = self.shard.num_local
        self.num, self.inter, self.fmt, self.block = num, inter, fmt, linear.block
        shapes = {"w13": (2 * inter, hidden), "w2": (hidden, inter)}
        for name, (n, k) in shapes.items():
            if fmt == "mxfp4":
                setattr(self, name, empty_param((num, n, k // FP4_BLOCK, FP4_BLOCK // 2), torch.uint8, device))
                setattr(self, name + "_scale", empty_param((num, n, k // FP4_BLOCK), torch.uint8, device))
            elif fmt == "fp8":
                setattr(self, name, empty_param((num, n, k), torch.float8_e4m3fn, device))
                grid = (num, math.ceil(n / self.block[0]), math.ceil(k / self.block[1]))
                setattr(self, name + "_scale", empty_param(grid, linear.scale_dtype, device))
            else:
                setattr(self, name, empty_param((num, n, k), dtype, device))
                setattr(self, name + "_scale", None)

    def experts(self) -> ExpertWeights:
        return ExpertWeights(self.fmt, self.w13, self.w2, self.w13_scale, self.w2_scale, workspace=self.fp8_workspace)

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        targets = {}
        i = self.inter
        for e in range(self.num):
            for name, stacked, rows in (("w1", "w13", slice(0, i)), ("w3", "w13", slice(i, 2 * i)), ("w2", "w2", slice(None))):
                base = f"{prefix}{self.shard.start + e}.{name}."
                targets[base + "weight"] = self._target(getattr(self, stacked)[e, rows], is_scale=False)
                if self.fmt != "bf16":
                    grid = rows if self.fmt == "mxfp4" or name == "w2" else slice(rows.start // self.block[0], rows.stop // self.block[0])
                    targets[base + "scale"] = self._target(getattr(self, stacked + "_scale")[e, grid], is_scale=True)
        return targets

    def _target(self, view: torch.Tensor, is_scale: bool) -> WeightTarget:
        """Checkpoint tensor -> one expert's slice of the stacked tensor (packed bytes are reinterpreted, not converted)."""
        if self.fmt == "mxfp4" and is_scale:  # F8_E8M0 [N, K/32] -> bytes
            spec = TensorSpec(tuple(view.shape), (torch.float8_e8m0fnu, torch.uint8))
            convert = lambda t: mxfp4.as_e8m0_bytes(t, "expert scale")  # noqa: E731
        elif self.fmt == "mxfp4":  # int8 [N, K/2], two E2M1 values per byte, even element low
            spec = TensorSpec((view.shape[0], view.shape[1] * view.shape[2]), torch.int8)
            convert = lambda t: t.view(torch.uint8).unflatten(-1, (-1, FP4_BLOCK // 2))  # noqa: E731
        else:
            return copy_target(view, "", check=SCALES if is_scale else None)
        return WeightTarget(spec, lambda t: view.copy_(convert(t)), dest=view,  # the same bytes
                            check=SCALES if is_scale else None)


class MoE(nn.Module):
    def __init__(self, spec: ModelSpec, layer: LayerSpec, linear: LinearFactory, dtype, device):
        super().__init__()
        e = layer.mlp.experts
        hidden = spec.hidden_size
        self.scaling = e.routing.scaling_factor
        self.activation = Activation("swiglu", limit=layer.mlp.activation.limit)
        self.gate = Router(e.num, hidden, e.top_k, spec.vocab_size, layer.mlp.kind == "hash_moe", dtype, device)
        self.experts = RoutedExperts(e.num, e.intermediate_size, hidden, e.format, linear, dtype, device)
        self.experts_op = MOE_EXPERT_OPS[e.format]
        self.shared_experts = nn.Module()  # whole on every tensor-parallel rank
        self.shared_experts.w1 = linear(hidden, e.shared_intermediate_size)
        self.shared_experts.w2 = linear(e.shared_intermediate_size, hidden)
        self.shared_experts.w3 = linear(hidden, e.shared_intermediate_size)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(0, 1)
        ids, weights = self.gate(flat, token_ids.flatten(), self.scaling)
        routed = self.experts.shard.run(self.experts_op, flat, ids, weights, self.experts.experts(), self.activation)
        s = self.shared_experts
        shared = s.w2(ops.swiglu(s.w1(flat), s.w3(flat), limit=self.activation.limit))
        return (routed + shared).view_as(x)


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, layer: LayerSpec, linear: LinearFactory, eps: float, dtype, device):
        super().__init__()
        hidden, n = spec.hidden_size, spec.cross_layer.hc_mult
        self.attn_norm = RMSNorm(hidden, eps, dtype=dtype, device=device)
        self.ffn_norm = RMSNorm(hidden, eps, dtype=dtype, device=device)
        for site in ("attn", "ffn"):  # float32, as shipped
            setattr(self, f"hc_{site}_fn", empty_param(((2 + n) * n, n * hidden), torch.float32, device))
            setattr(self, f"hc_{site}_base", empty_param(((2 + n) * n,), torch.float32, device))
            setattr(self, f"hc_{site}_scale", empty_param((3,), torch.float32, device))
        self.attn = Attention(hidden, layer, linear, eps, dtype, device)
        self.ffn = MoE(spec, layer, linear, dtype, device)

    def forward(self, streams, token_ids, positions, rope: Rope, state: dict, hc: tuple[int, float, float]):
        x, post, comb = ops.hyper_connection(streams, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, *hc)
        streams = ops.hyper_connection_post(self.attn(self.attn_norm(x), positions, rope, state), streams, post, comb)
        x, post, comb = ops.hyper_connection(streams, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, *hc)
        return ops.hyper_connection_post(self.ffn(self.ffn_norm(x), token_ids), streams, post, comb)


def _ropes(config: dict, rope_dim: int) -> tuple[Rope, Rope]:
    """(main, compress): plain RoPE with rope_theta for window-only layers; compressed layers use
    compress_rope_theta with the config's scaling (YaRN) and no cos/sin scaling."""
    params = config.get("rope_parameters") or {}
    if isinstance(params.get("compress"), dict):  # transformers-saved configs nest {main, compress}
        main, compress = params.get("main") or {}, dict(params["compress"])
    else:
        main, compress = {}, dict(config.get("rope_scaling") or params)
    main_rope = rope_from_config({"rope_type": main.get("rope_type", "default")}, rope_dim,
                                 float(main.get("rope_theta", config.get("rope_theta", 10000.0))))
    compress["rope_theta"] = float(compress.get("rope_theta", config.get("compress_rope_theta", 160000.0)))
    if compress.get("rope_type", compress.get("type")) == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return main_rope, rope_from_config(compress, rope_dim, compress["rope_theta"], config.get("max_position_embeddings"))


@register_model
class DeepseekV4ForCausalLM(CausalLM):
    model_types = ("deepseek_v4",)
    ignore_unexpected = (r"^mtp\.",)
    tensor_parallel = True  # attention heads (wq_b, wo_a groups, wo_b, sinks), vocabulary; the rest whole
    expert_parallel = True

    def ignore_patterns(self) -> tuple[str, ...]:
        e = self.spec.experts
        return self.ignore_unexpected + (() if e is None else other_ranks_experts(e.num, self.parallel, r"\.ffn\.experts\."))

    def layouts(self) -> tuple[Layout, ...]:
        return LAYOUTS

    def __init__(self, spec: ModelSpec, config: dict, dtype: torch.dtype, device: torch.device | str):
        super().__init__(spec, config, dtype, device)
        config = self.config
        hidden, eps = spec.hidden_size, float(config["rms_norm_eps"])
        linear = LinearFactory(spec, dtype, device)
        cross = spec.cross_layer
        self.hc = (cross.hc_sinkhorn_iters, cross.hc_eps, eps)
        self.embed = VocabEmbedding(spec.vocab_size, hidden, dtype=dtype, device=device)
        self.layers = nn.ModuleList(Block(spec, layer, linear, eps, dtype, device) for layer in spec.layers)
        self.norm = RMSNorm(hidden, eps, dtype=dtype, device=device)
        self.head = ColumnLinear(hidden, spec.vocab_size, gather=True, name="head (vocab_size)", dtype=dtype,
                                 device=device)
        n = cross.hc_mult
        self.hc_head_fn = empty_param((n, n * hidden), torch.float32, device)
        self.hc_head_base = empty_param((n,), torch.float32, device)
        self.hc_head_scale = empty_param((1,), torch.float32, device)
        self.rope_main, self.rope_compress = _ropes(config, spec.layers[0].attention.qk_rope_head_dim)

    def cuda_graph_blocker(self, max_model_len: int) -> str | None:
        return None  # decodes read the streams in place and write one candidate entry a row (_BlockView)

    def forward_packed(self, input_ids: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        ids, positions = input_ids[None], positions[None]  # the blocks below are token-local: one row of N tokens
        x = self.embed(ids)
        streams = x.unsqueeze(2).expand(-1, -1, self.spec.cross_layer.hc_mult, -1).contiguous()
        for i, block in enumerate(self.layers):
            rope = self.rope_main if block.attn.kind == "swa" else self.rope_compress
            streams = block(streams, ids, positions, rope, cache.layers[i], self.hc)
        streams = streams[0]
        if cache.logits_indices is not None:
            streams = streams[cache.logits_indices]
        x = ops.hyper_connection(streams, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, *self.hc)[0]
        return self.head(self.norm(x)).float()


class _GroupCache:
    """A layer's paged view seen as [B, T] blocks of sequences (module docstring): `groups()` yields
    (token rows, (B, T), view) per block; a view's `append(name, new [B, n, *entry])` writes the block's
    part of the step's entries and returns the stream; states read the block's rows and are written
    once for the layer by `commit()`."""

    def __init__(self, cache, ratio: int):
        self.cache, self.ratio, self.seqs = cache, ratio, cache.seqs
        self.probing = not hasattr(cache, "meta")  # probe_layout's recording cache: write through at once
        self.states: dict[str, list[torch.Tensor]] = {}

    def groups(self):
        seqs = self.seqs
        fresh = (True,) * seqs.num_seqs if self.probing else self.cache.meta.fresh
        keys = [(t, ctx if t > 1 else None, fresh[b]) for b, (ctx, t) in enumerate(zip(seqs.context_lens, seqs.query_lens))]
        first = 0
        for b in range(1, seqs.num_seqs + 1):
            if b == seqs.num_seqs or keys[b] != keys[first]:
                rows = slice(seqs.query_start_host[first], seqs.query_start_host[b])
                yield rows, (b - first, seqs.query_lens[first]), _BlockView(self, first, b, keys[first][2])
                first = b

    def first_entry(self, seq: int, rate: int) -> int:
        """How many entries of a stream of `rate` the step's sequences before `seq` append."""
        seqs = self.seqs
        return sum((c + t) // rate - c // rate for c, t in zip(seqs.context_lens[:seq], seqs.query_lens[:seq]))

    def commit(self) -> None:
        for name, parts in self.states.items():
            self.cache[name] = torch.cat(parts)


class _BlockView:
    """One block's view (`_GroupCache`). paged (every block of a real step): `append` writes the block's
    entries at once and returns the stream (PagedStream) for the paged ops to read in place, `rows_seq`
    the sequence of each of the block's token rows. The layout probe's one token (paged False) writes
    through its recording cache, and `append` returns the token's own entries for the gathered ops."""

    def __init__(self, owner: _GroupCache, first: int, end: int, fresh: bool):
        self.owner, self.first, self.end, self.fresh = owner, first, end, fresh
        self.paged = not owner.probing
        self._rows_seq: torch.Tensor | None = None

    def rows_seq(self, t: int, device) -> torch.Tensor | None:
        """The sequence of each of the block's B x t token rows (None where row b is sequence b)."""
        if self.first == 0 and t == 1:
            return None
        if self._rows_seq is None:
            self._rows_seq = torch.arange(self.first, self.end, device=device).repeat_interleave(t)
        return self._rows_seq

    def append(self, name: str, new: torch.Tensor, window: int | None = None, rate: int = 1) -> torch.Tensor:
        seqs = self.owner.seqs
        if self.paged and rate > 1 and self.owner.cache.meta.candidates is not None:  # a graph's step: every
            return self.owner.cache.append_candidates(name, new.flatten(0, 1))  # row's candidate, scratch or not
        ctxs = seqs.context_lens[self.first:self.end]
        written = new
        if rate > 1 and seqs.query_lens[self.first] == 1:  # decodes: each row's candidate entry, kept by the
            keep = [i for i, ctx in enumerate(ctxs) if (ctx + 1) % rate == 0]  # rows whose window completes
            written = new if len(keep) == len(ctxs) else new[keep]
        if self.owner.probing:
            self.owner.cache.append(name, written.flatten(0, 1), window, rate)
            return new
        return self.owner.cache.append_part(name, written.flatten(0, 1), self.owner.first_entry(self.first, rate))

    def get(self, name: str, default=None):
        if self.fresh:
            return default
        value = self.owner.cache.get(name)
        return default if value is None else value[self.first:self.end]

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        if self.owner.probing:
            self.owner.cache[name] = value
        else:
            self.owner.states.setdefault(name, []).append(value)
