"""The per-GPU memory plan of a tensor x expert parallel job (`dayzero inspect --tp T --ep E`), the split
chosen for a number of GPUs, and the layout: the fewest GPUs that hold a model and its context.

A job is tp x ep processes, one GPU each (dayzero.parallel.state); every rank holds the same bytes:
    weights     dayzero.rank_weights: attention heads and the vocabulary over tp, routed experts over ep,
                the rest whole, tensor by tensor as the model files hold them, plus what they derive at load
    workspace   the FP8 expert workspace of 4-bit experts (dayzero.plan.WorkspacePolicy) for the rank's
                E / ep experts, the only ones it activates
    reserve     the activation reserve, as dayzero.plan
    cache       planned from the rank's share of the spec (dayzero.parallel.spec.local_spec, what every rank's
                engine plans its KV pool from): GQA K/V heads and KDA states split over tp; MLA's latent,
                DSA / CSA index keys and DeepSeek-V4's entries whole on every rank (one KV head)
Every rank holds every sequence (attention is replicated over the ep groups), so a sequence's longest
context is (free per GPU - its bounded bytes) / its bytes per token per GPU, no sum over GPUs.

A split is valid where the model can make it: heads, KV heads, V4's o_groups, the vocabulary and the
dense widths divide by tp (FP8 shares whole 128 blocks), the experts by ep; else the ValueError names
the field (dayzero.parallel.state's message).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dayzero.parallel.spec import local_spec
from dayzero.parallel.state import Parallel
from dayzero.plan import GIB, H200_GPU_MEM_GIB, WorkspacePolicy, cache_totals, context_fit, expert_workspace_bytes, layer_cache
from dayzero.rank_weights import CATEGORIES, rank_weights
from dayzero.spec import ModelSpec

CAPACITY_CONTEXTS = (131072, 1048576)  # sequence lengths the plan counts concurrent sequences at (128K, 1M)
GPUS_PER_NODE = 8  # one H200 node; a job over more spans nodes (--nnodes: docs/parallel.md)
MAX_LAYOUT_GPUS = 512


@dataclass(frozen=True)
class RankPlan:
    tp: int
    ep: int
    gpu_mem_gib: float
    kv_dtype: str
    weights_gib_per_gpu: float  # loaded + derived
    weights_by_category: dict  # category -> {"gib": per GPU, "whole_gib": of it held whole on every GPU}
    experts_per_gpu: int  # routed experts a GPU holds (E / ep; 0: no experts)
    num_experts: int
    expert_workspace_gib_per_gpu: float
    activation_reserve_gib_per_gpu: float
    free_for_cache_gib_per_gpu: float
    cache_bytes_per_token_per_gpu: float
    cache_fixed_gib_per_gpu: float  # one sequence's bounded cache: windows, compressor and KDA states
    cache_by_attention_kind: dict  # kind -> layers, bytes per token and bounded bytes per GPU, split or whole
    max_context_tokens: int  # one sequence (not capped)
    context_limit: int  # min(max_context_tokens, max_position_embeddings)
    sequences_at_context: dict  # str(tokens) -> sequences of that length the free memory holds at once (None:
    # past max_position_embeddings)
    context: int | None = None
    context_cache_gib: float | None = None
    context_fits: bool | None = None

    @property
    def gpus(self) -> int:
        return self.tp * self.ep

    def to_dict(self) -> dict:
        return {"gpus": self.gpus, **asdict(self)}

    def summary(self) -> dict:
        """The few numbers that compare one split with another."""
        return {"tp": self.tp, "ep": self.ep, "weights_gib_per_gpu": self.weights_gib_per_gpu,
                "free_for_cache_gib_per_gpu": self.free_for_cache_gib_per_gpu,
                "max_context_tokens": self.max_context_tokens, "context_fits": self.context_fits}


def _cache(spec: ModelSpec, tp: int, kv_dtype: str) -> tuple[float, float, dict]:
    """(bytes per token, bounded bytes, by kind) of one sequence on a rank of tensor-parallel size tp."""
    local = local_spec(spec, Parallel(tp_size=tp))
    per_token, fixed = cache_totals(local, kv_dtype)
    kinds: dict[str, dict] = {}
    for whole, mine in zip(spec.layers, local.layers):
        kind = mine.attention.kind
        if kind in kinds:
            kinds[kind]["layers"] += 1
            continue
        part, full = layer_cache(mine.attention, kv_dtype), layer_cache(whole.attention, kv_dtype)
        kinds[kind] = {"layers": 1, "bytes_per_token_per_gpu": part.per_token, "fixed_bytes_per_gpu": part.fixed,
                       "split": (part.per_token, part.fixed) != (full.per_token, full.fixed)}
    return per_token, fixed, kinds


def rank_plan(spec: ModelSpec, tp: int = 1, ep: int = 1, gpu_mem_gib: float = H200_GPU_MEM_GIB, *,
              context: int | None = None, kv_dtype: str = "bf16", activation_reserve_gib: float = 8.0,
              workspace: WorkspacePolicy = WorkspacePolicy()) -> RankPlan:
    """What each GPU of a tp x ep job holds, and one sequence's fit (ValueError: an invalid split)."""
    if tp < 1 or ep < 1:
        raise ValueError(f"tp and ep must be >= 1, got tp {tp}, ep {ep}")
    if context is not None and context < 1:
        raise ValueError(f"context must be at least 1 token, got {context}")
    weights = rank_weights(spec, Parallel(tp_size=tp, ep_size=ep))
    per_token, fixed, kinds = _cache(spec, tp, kv_dtype)
    ws = expert_workspace_bytes(spec, ep, workspace)  # min(E / ep, top_k x tokens) experts
    free = gpu_mem_gib * GIB - weights.total - ws - activation_reserve_gib * GIB
    max_position = spec.context.max_position_embeddings
    max_ctx, ctx_gib, fits = context_fit(free, per_token, fixed, max_position, context)
    return RankPlan(
        tp=tp, ep=ep, gpu_mem_gib=gpu_mem_gib, kv_dtype=kv_dtype,
        weights_gib_per_gpu=weights.total / GIB,
        weights_by_category={c: {"gib": weights.bytes(c) / GIB, "whole_gib": weights.whole[c] / GIB}
                             for c in CATEGORIES},
        experts_per_gpu=spec.experts.num // ep if spec.experts else 0,
        num_experts=spec.experts.num if spec.experts else 0,
        expert_workspace_gib_per_gpu=ws / GIB,
        activation_reserve_gib_per_gpu=activation_reserve_gib,
        free_for_cache_gib_per_gpu=free / GIB,
        cache_bytes_per_token_per_gpu=per_token,
        cache_fixed_gib_per_gpu=fixed / GIB,
        cache_by_attention_kind=kinds,
        max_context_tokens=max_ctx,
        context_limit=min(max_ctx, max_position),
        sequences_at_context={str(n): max(0, int(free // (n * per_token + fixed))) if n <= max_position else None
                              for n in CAPACITY_CONTEXTS},
        context=context, context_cache_gib=ctx_gib, context_fits=fits,
    )


def splits(gpus: int) -> list[tuple[int, int]]:
    """Every (tp, ep) with tp x ep = gpus, tp ascending."""
    return [(tp, gpus // tp) for tp in range(1, gpus + 1) if gpus % tp == 0]


def split_plans(spec: ModelSpec, gpus: int, **plan_args) -> tuple[list[RankPlan], dict[str, str]]:
    """(the plans of the valid splits of gpus, why each other split is invalid: "tp T x ep E" -> error)."""
    plans, invalid = [], {}
    for tp, ep in splits(gpus):
        try:
            plans.append(rank_plan(spec, tp, ep, **plan_args))
        except ValueError as exc:
            invalid[f"tp {tp} x ep {ep}"] = str(exc)
    return plans, invalid


def _rank(plan: RankPlan) -> tuple:
    return plan.max_context_tokens, plan.free_for_cache_gib_per_gpu


def best_split(spec: ModelSpec, gpus: int, **plan_args) -> tuple[RankPlan | None, list[RankPlan], dict[str, str]]:
    """The valid split of gpus with the longest context (then the most free memory), or None; the other
    valid splits; the invalid ones with their reasons."""
    plans, invalid = split_plans(spec, gpus, **plan_args)
    best = max(plans, key=_rank) if plans else None
    return best, [p for p in plans if p is not best], invalid


@dataclass(frozen=True)
class Layout:
    """The fewest GPUs whose best split holds one sequence of `context` tokens."""

    context: int
    plan: RankPlan
    alternatives: list  # the other valid splits of the same GPUs (RankPlan)

    @property
    def gpus(self) -> int:
        return self.plan.gpus

    def to_dict(self) -> dict:
        return {"gpus": self.gpus, "nodes": -(-self.gpus // GPUS_PER_NODE), "context": self.context,
                "tp": self.plan.tp, "ep": self.plan.ep, "plan": self.plan.to_dict(),
                "alternatives": [p.summary() for p in self.alternatives]}


def fewest_gpus(spec: ModelSpec, context: int | None = None, max_gpus: int = MAX_LAYOUT_GPUS,
                **plan_args) -> Layout | None:
    """The smallest number of GPUs with a valid split that holds one sequence of `context` tokens (default:
    the model's max_position_embeddings), that split (the longest context of those that fit) and the
    others; None when none up to max_gpus does."""
    context = context or spec.context.max_position_embeddings
    for gpus in range(1, max_gpus + 1):
        plans, _ = split_plans(spec, gpus, context=context, **plan_args)
        fitting = [p for p in plans if p.context_fits]
        if fitting:
            best = max(fitting, key=_rank)
            return Layout(context, best, [p for p in plans if p is not best])
    return None
