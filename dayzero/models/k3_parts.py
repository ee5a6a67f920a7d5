"""Kimi K3's additions to the Kimi Linear decoder, as modules that load by the real checkpoint names.

The published checkpoint (moonshotai/Kimi-K3, `model_type: kimi_k3` wrapper, text tower
`kimi_linear`) stores every text tensor under `language_model.`; inside it the names below are
relative to `model.layers.{i}.` unless they start with `model.`. docs/kimi_k3.md has the sources.

Block Attention Residuals (`attn_res_block_size` B):
    self_attention_res_norm.weight [D], self_attention_res_proj.weight [1, D]   before attention
    mlp_res_norm.weight [D],            mlp_res_proj.weight [1, D]              before the MLP
    model.output_attn_res_norm.weight,  model.output_attn_res_proj.weight       after the last layer
  `AttentionResidual` mounted as `self_attention_res`, `mlp_res` or `output_attn_res` loads its
  pair; `AttentionResidualState` keeps the candidates of one forward (see its docstring).
Latent MoE (`routed_expert_hidden_size` L, `latent_moe_use_norm`), under `block_sparse_moe.`:
    routed_expert_down_proj.weight [L, D], routed_expert_norm.weight [L], routed_expert_up_proj.weight [D, L]
    experts.{j}.w1 / w3 (gate / up) [I, L] and w2 (down) [L, I] as compressed-tensors
    mxfp4-pack-quantized: weight_packed uint8 [out, in/2], weight_scale uint8 E8M0 [out, in/32]
  The router (`gate.weight` [E, D], `gate.e_score_correction_bias` [E]) reads the hidden state D,
  the shared experts (`shared_experts.{gate,up,down}_proj`, width num_shared * I) too.
MLA output gate (`mla_use_output_gate`): self_attn.g_proj.weight [heads * v_head_dim, D].
"""

from __future__ import annotations

import torch
from torch import nn

from dayzero import ops
from dayzero.formats import mxfp4
from dayzero.models.base import WeightTarget, collect_weight_targets, copy_target, empty_param
from dayzero.weights.values import SCALES
from dayzero.models.layers import Linear, RMSNorm
from dayzero.models.sharded import ColumnLinear, ExpertShard
from dayzero.ops.moe import Activation, ExpertWeights
from dayzero.weights import TensorSpec

# The three checkpoint names of a routed expert and where each lands in the canonical stacked
# layout (ops/moe.py): w1 = gate -> w13 rows [0, I), w3 = up -> w13 rows [I, 2I), w2 = down -> w2.
_EXPERT_PROJECTIONS = (("w1", "w13", 0), ("w3", "w13", 1), ("w2", "w2", None))


class AttentionResidual(nn.Module):
    """One Block Attention Residuals mixing point: h = sum_i softmax_i(w . RMSNorm(v_i)) v_i.

    Mount it under the attribute that is the checkpoint stem (`self_attention_res`, `mlp_res`,
    `output_attn_res`): it loads `{stem}_norm.weight` [D] and `{stem}_proj.weight` [1, D] beside
    itself, not below it. Its own parameters are named `norm_weight` / `proj_weight`, so the
    legacy spellings `{stem}.norm_weight` / `{stem}.proj_weight` (which mlxcel also accepts) are
    what an unmapped state_dict would show. eps is `rms_norm_eps`.
    """

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.eps = eps
        self.norm_weight = empty_param((hidden,), dtype, device)
        self.proj_weight = empty_param((1, hidden), dtype, device)

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        stem = prefix.rstrip(".")
        return {f"{stem}_norm.weight": copy_target(self.norm_weight, f"{stem}_norm.weight"),
                f"{stem}_proj.weight": copy_target(self.proj_weight, f"{stem}_proj.weight")}

    def forward(self, candidates: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        """candidates: [N, ..., D] or a list of N tensors [..., D] -> the mix [..., D]."""
        if not isinstance(candidates, torch.Tensor):
            candidates = torch.stack(list(candidates))
        return ops.attention_residual(candidates, self.proj_weight, self.norm_weight, self.eps)


class AttentionResidualState:
    """The Block AttnRes candidates of one forward pass, per token; nothing is cached across calls.

    The tensor a layer passes on is the current block's partial sum. With layers numbered from 0
    and block size B, the published `modeling_kimi_linear.py` (`KimiDecoderLayer` with
    `_apply_attn_res`) does, per layer l:

        h = self_attention_res(blocks + [partial])       # attention_input(res, l)
        if l % B == 0: blocks.append(partial); partial = None
        partial += attn(input_layernorm(h))               # add(out); partial = out when None
        h = mlp_res(blocks + [partial])                   # mlp_input(res)
        partial += mlp(post_attention_layernorm(h))       # add(out)
    and after the last layer h = output_attn_res(blocks + [partial]) feeds the final norm.

    So blocks[0] is the embedding (pushed at layer 0, whose attention input is the embedding
    itself), blocks[n] (n >= 1) is the sum of the 2B sublayer outputs (attention and MLP) of
    layers (n-1)B ... nB-1, and a block completes when layer nB starts: the mix before that
    layer's attention sees it as the partial, the mix after it as a block. A mix sees at most
    ceil(L / B) + 1 candidates (K3: 93 layers, B = 12 -> 9). Partial sums stay in the model dtype,
    as upstream's prefix_sum does.
    """

    def __init__(self, embedding: torch.Tensor, block_size: int):
        if block_size < 1:
            raise ValueError(f"attn_res_block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.blocks: list[torch.Tensor] = []
        self.partial: torch.Tensor | None = embedding

    def candidates(self) -> torch.Tensor:
        """[N, ..., D]: the completed blocks (embedding first), then the partial sum if any."""
        return torch.stack(self.blocks + ([] if self.partial is None else [self.partial]))

    def attention_input(self, res: AttentionResidual, layer_idx: int) -> torch.Tensor:
        """The input of layer `layer_idx`'s attention (before input_layernorm); starts a new block
        at multiples of the block size."""
        h = res(self.candidates())
        if layer_idx % self.block_size == 0:
            self.blocks.append(self.partial)
            self.partial = None
        return h

    def mlp_input(self, res: AttentionResidual) -> torch.Tensor:
        """The input of the current layer's MLP (before post_attention_layernorm)."""
        return res(self.candidates())

    def add(self, sublayer_output: torch.Tensor) -> None:
        """Add an attention or MLP output to the current block's partial sum."""
        self.partial = sublayer_output if self.partial is None else self.partial + sublayer_output

    def output(self, res: AttentionResidual) -> torch.Tensor:
        """The model-level mix after the last layer (`output_attn_res`), input of the final norm."""
        return res(self.candidates())


class MLAOutputGate(ColumnLinear):
    """K3 gated MLA (`mla_use_output_gate`): o = o * sigmoid(g_proj(x)) right before o_proj.

    Mount as `self_attn.g_proj` (weight [heads * v_head_dim, hidden], no bias in K3). x is the
    attention's input (after input_layernorm), o the per-head attention output flattened to
    [..., heads * v_head_dim]; the gate is elementwise, computed in o's dtype. `bias` follows
    `attention_bias` (False in K3). A tensor-parallel rank holds the rows of its heads (a ColumnLinear:
    rows [r * width / tp, ...), heads [r * heads / tp, ...) of v_head_dim each) and gates their output.
    """

    def __init__(self, hidden: int, width: int, *, bias: bool = False, dtype: torch.dtype = torch.float32, device=None):
        super().__init__(hidden, width, bias=bias, name="self_attn.g_proj", dtype=dtype, device=device)

    def forward(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if o.shape[-1] != self.weight.shape[0] or o.shape[:-1] != x.shape[:-1]:
            raise ValueError(
                f"MLAOutputGate: attention output {tuple(o.shape)} must be [..., {self.weight.shape[0]}] with the "
                f"leading dims of the attention input {tuple(x.shape)}"
            )
        return o * torch.sigmoid(super().forward(x).to(o.dtype))


class CompressedTensorsMxfp4Experts(nn.Module):
    """Routed experts shipped per expert in compressed-tensors `mxfp4-pack-quantized` form, held
    stacked and packed in the canonical MXFP4 layout of dayzero.ops.moe (0.53 bytes per weight).

    Mount as `block_sparse_moe.experts`. On disk, per expert j and projection w1 (gate), w3 (up),
    w2 (down): `{j}.{w}.weight_packed` uint8 [out, in/2] (E2M1 pairs, even element in the low
    nibble) and `{j}.{w}.weight_scale` uint8 [out, in/32] (E8M0, one per 32 along in; float8_e8m0fnu
    is accepted too). In memory: w13 uint8 [E, 2I, K/32, 16] (gate rows first), w13_scale
    [E, 2I, K/32], w2 [E, K, I/32, 16], w2_scale [E, K, I/32], with K = `input_dim` (the latent
    width L for a latent MoE, else hidden). The bytes are copied as they are, never re-encoded.
    An expert-parallel rank holds experts [start, stop) of the `num` (ExpertShard: E above is its share)
    and loads only their tensors; its forward returns the sum over every rank's experts.
    """

    fp8_workspace = None  # the engine's FP8 expert workspace, passed with the weights (dayzero/engine/llm.py)

    def __init__(self, num: int, intermediate: int, input_dim: int, device=None):
        super().__init__()
        for name, value in (("intermediate", intermediate), ("input_dim", input_dim)):
            if value % mxfp4.BLOCK_SIZE:
                raise ValueError(f"CompressedTensorsMxfp4Experts: {name} {value} must be a multiple of {mxfp4.BLOCK_SIZE} "
                                 "(one E8M0 scale per 32 values along K)")
        self.shard = ExpertShard(num)
        num = self.shard.num_local
        self.num, self.intermediate, self.input_dim = num, intermediate, input_dim
        half = mxfp4.BLOCK_SIZE // 2
        for name, (n, k) in {"w13": (2 * intermediate, input_dim), "w2": (input_dim, intermediate)}.items():
            setattr(self, name, empty_param((num, n, k // mxfp4.BLOCK_SIZE, half), torch.uint8, device))
            setattr(self, name + "_scale", empty_param((num, n, k // mxfp4.BLOCK_SIZE), torch.uint8, device))

    def experts(self) -> ExpertWeights:
        return ExpertWeights("mxfp4", self.w13, self.w2, self.w13_scale, self.w2_scale, workspace=self.fp8_workspace)

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        targets = {}
        i = self.intermediate
        for e in range(self.num):
            for name, stacked, half in _EXPERT_PROJECTIONS:
                rows = slice(None) if half is None else slice(half * i, (half + 1) * i)
                blocks = getattr(self, stacked)[e, rows]  # [out, K/32, 16]
                scales = getattr(self, stacked + "_scale")[e, rows]  # [out, K/32]
                base = f"{prefix}{self.shard.start + e}.{name}."
                targets[base + "weight_packed"] = _packed_target(blocks)
                targets[base + "weight_scale"] = _scale_target(scales)
        return targets

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                activation: Activation) -> torch.Tensor:
        """x [T, K], topk_ids / topk_weights [T, k] (the model's expert ids) -> sum_k w * expert(x) [T, K]."""
        return self.shard.run(ops.moe_experts_mxfp4, x, topk_ids, topk_weights, self.experts(), activation)


def _packed_target(blocks: torch.Tensor) -> WeightTarget:
    """weight_packed uint8 [out, K/2] -> blocks [out, K/32, 16]: the same bytes, regrouped per 32 values."""
    spec = TensorSpec((blocks.shape[0], blocks.shape[1] * blocks.shape[2]), torch.uint8)

    def assign(t: torch.Tensor) -> None:
        with torch.no_grad():
            blocks.copy_(t.unflatten(-1, (-1, mxfp4.BLOCK_SIZE // 2)))

    return WeightTarget(spec, assign, dest=blocks)  # the same bytes


def _scale_target(scales: torch.Tensor) -> WeightTarget:
    spec = TensorSpec(tuple(scales.shape), (torch.uint8, torch.float8_e8m0fnu))

    def assign(t: torch.Tensor) -> None:
        with torch.no_grad():
            scales.copy_(mxfp4.as_e8m0_bytes(t, "weight_scale"))

    return WeightTarget(spec, assign, dest=scales, check=SCALES)  # the same bytes


class LatentMoE(nn.Module):
    """K3's routed branch in latent space (LatentMoE):

        z = routed_expert_down_proj(x)                       [T, L]   (one projection shared by all experts)
        y = sum_k w_k * expert_k(z)                          [T, L]   (SiTU experts, I wide)
        y = routed_expert_norm(y)                            when latent_moe_use_norm
        out = routed_expert_up_proj(y)                       [T, D]

    The norm sits after the weighted expert sum, before the up-projection (mlxcel
    `KimiK3SparseMoE`, Megatron `moe_latent_use_norm`: "RMSNorm the combined routed output in
    latent space before fc2_latent_proj"). Routing (on x, in model space) and the shared experts
    (on x) stay with the caller: topk_weights already carry `routed_scaling_factor`.

    Mounted transparently: its tensors are named relative to the module that holds it, so with
    `block_sparse_moe.routed = LatentMoE(...)` the checkpoint names are
    `block_sparse_moe.routed_expert_down_proj.weight`, `block_sparse_moe.experts.{j}.w1.weight_packed`, ...
    `experts` is any module with `forward(z, topk_ids, topk_weights, activation)` (for K3,
    `CompressedTensorsMxfp4Experts` with input_dim = L) that returns the sum over all experts: split over
    expert-parallel ranks, it combines them, so that the norm sees the whole sum. The projections and the
    norm are whole on every rank (every rank has every token).
    """

    def __init__(self, hidden: int, latent: int, experts: nn.Module, activation: Activation, *, use_norm: bool,
                 eps: float, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.activation = activation
        self.routed_expert_down_proj = Linear(hidden, latent, dtype=dtype, device=device)
        self.experts = experts
        self.routed_expert_norm = RMSNorm(latent, eps, dtype, device) if use_norm else None
        self.routed_expert_up_proj = Linear(latent, hidden, dtype=dtype, device=device)

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        stem = prefix.rstrip(".")
        parent = stem[: stem.rfind(".") + 1] if "." in stem else ""
        return collect_weight_targets(self, parent)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, D] and the routing of x -> the routed experts' contribution [T, D]."""
        y = self.experts(self.routed_expert_down_proj(x), topk_ids, topk_weights, self.activation)
        if self.routed_expert_norm is not None:
            y = self.routed_expert_norm(y)
        return self.routed_expert_up_proj(y)
