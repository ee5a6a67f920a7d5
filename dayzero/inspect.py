"""`dayzero inspect`: what a checkpoint is, what it needs, and whether it fits.

`build_report(path_or_spec, gpus, gpu_mem_gib, context, tp=, ep=, layout=)` returns a plain dict (the
`--json` output): features, per-layer kinds, parameter counts, ops needed with the backends that cover
them, the memory plan of the parameter counts spread evenly over the GPUs ("memory"), the per-GPU plan
of a tp x ep split as the ranks hold it ("split": the given split, or the best valid split of the GPUs;
dayzero.split_plan) and, with layout, the fewest GPUs that hold one sequence of the context ("layout").
`format_report(report)` renders it as text tables: "memory" on one GPU, "split" on more or with tp / ep
given. Only config.json is read; docs/inspect.md states every convention.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from dayzero import plan, split_plan
from dayzero.ops import requirements
from dayzero.units import format_bytes, format_count, format_gib
from dayzero.spec import ModelSpec, load_spec

MAX_PERIOD = 4  # longest repeating layer pattern folded into one run, e.g. (kda, kda, kda, mla)


def compress_runs(labels: list[str]) -> list[tuple[int, int, tuple[str, ...]]]:
    """Fold per-layer labels into (first, last, pattern) runs: a pattern of 1..MAX_PERIOD labels
    repeated over layers first..last (whole repetitions only)."""
    runs: list[tuple[int, int, tuple[str, ...]]] = []
    i, n = 0, len(labels)
    while i < n:
        j = i + 1
        while j < n and labels[j] == labels[i]:
            j += 1
        best_p, best_len = 1, j - i
        for p in range(2, MAX_PERIOD + 1):
            if i + 2 * p > n or len(set(labels[i : i + p])) == 1:
                continue
            k = i + p
            while k < n and labels[k] == labels[k - p]:
                k += 1
            length = (k - i) // p * p
            if length >= 2 * p and length > best_len:
                best_p, best_len = p, length
        runs.append((i, i + best_len - 1, tuple(labels[i : i + best_p])))
        i += best_len
    return runs


def format_runs(runs: list[tuple[int, int, tuple[str, ...]]]) -> list[str]:
    out = []
    for first, last, pattern in runs:
        where = f"layer {first}" if first == last else f"layers {first}-{last}"
        if len(pattern) == 1:
            out.append(f"{where}: {pattern[0]}")
        else:
            reps = (last - first + 1) // len(pattern)
            out.append(f"{where}: ({', '.join(pattern)}) x{reps}")
    return out


def _ops_table(spec: ModelSpec) -> list[dict]:
    used_by: dict[str, list[str]] = {}
    for layer in spec.layers:
        for op in requirements.required_ops(layer):
            used_by.setdefault(op, []).append(f"{layer.attention.kind}+{layer.mlp.kind}")
    for part, ops in requirements.model_level_ops(spec).items():
        for op in ops:
            used_by.setdefault(op, []).append(part)
    rows = []
    for op, users in used_by.items():
        backends = requirements.backends_for(op)
        rows.append({"op": op, "backends": backends, "used_by": list(dict.fromkeys(users))})
    return rows


def _cache_by_kind(spec: ModelSpec) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for layer in spec.layers:
        a = layer.attention
        if a.kind in out:
            out[a.kind]["layers"] += 1
            continue
        bf16, fp8 = plan.layer_cache(a, "bf16"), plan.layer_cache(a, "fp8")
        out[a.kind] = {
            "layers": 1,
            "bytes_per_token_bf16": bf16.per_token,
            "bytes_per_token_fp8": fp8.per_token,
            "fixed_bytes_bf16": bf16.fixed,
            "fixed_bytes_fp8": fp8.fixed,
            "window": bf16.window,
            "detail_bf16": bf16.detail,
        }
    return out


def _refused_today(spec: ModelSpec, tp: int, ep: int) -> str | None:
    """Why the model file cannot run this split today (None: it can)."""
    from dayzero.models import model_class

    try:
        model_class(spec).check_parallel(spec.model_type, tp, ep)
    except (NotImplementedError, ValueError) as exc:
        return str(exc)
    return None


def resolve_split(gpus: int | None, tp: int | None, ep: int | None) -> tuple[int, int | None, int | None]:
    """(GPUs, tp, ep) of --gpus / --tp / --ep: the one of tp and ep not given is what the GPUs leave
    (1 without --gpus); neither given: (gpus or 1, None, None), the split to be chosen. ValueError naming
    the flags where they contradict."""
    if tp is None and ep is None:
        return gpus or 1, None, None
    if gpus is not None and (tp is None or ep is None):
        flag, given = ("--tp", tp) if ep is None else ("--ep", ep)
        if gpus % given:
            raise ValueError(f"--gpus {gpus} is not a multiple of {flag} {given}; give a {flag} that divides "
                             "--gpus, or --gpus alone to choose the split")
        tp, ep = (tp, gpus // tp) if ep is None else (gpus // ep, ep)
    tp, ep = tp or 1, ep or 1
    if gpus is not None and tp * ep != gpus:
        raise ValueError(f"--gpus {gpus} is not --tp {tp} x --ep {ep} = {tp * ep} GPUs; give --tp and --ep "
                         "alone, or --gpus alone to choose the split")
    return tp * ep, tp, ep


def _split_report(spec: ModelSpec, gpus: int, tp: int | None, ep: int | None, context: int | None,
                  plan_args: dict) -> dict:
    """The per-GPU plan of tp x ep, or (neither given) of the best valid split of gpus and the others."""
    if tp is None:
        best, others, invalid = split_plan.best_split(spec, gpus, context=context, **plan_args)
    else:
        best, others, invalid = split_plan.rank_plan(spec, tp, ep, context=context, **plan_args), [], {}
    return {"gpus": gpus, "chosen": tp is None, "plan": best and best.to_dict(),
            "others": [p.summary() for p in others], "invalid": invalid,
            "refused_today": best and _refused_today(spec, best.tp, best.ep)}


def _layout_report(spec: ModelSpec, context: int | None, plan_args: dict) -> dict:
    """The fewest GPUs that hold one sequence of `context` tokens (default max_position_embeddings)."""
    fewest = split_plan.fewest_gpus(spec, context, **plan_args)
    if fewest is None:
        return {"gpus": None, "max_gpus": split_plan.MAX_LAYOUT_GPUS,
                "context": context or spec.context.max_position_embeddings}
    return {**fewest.to_dict(), "refused_today": _refused_today(spec, fewest.plan.tp, fewest.plan.ep)}


def build_report(
    path_or_spec: str | Path | Mapping[str, Any] | ModelSpec,
    gpus: int | None = None,
    gpu_mem_gib: float = plan.H200_GPU_MEM_GIB,
    context: int | None = None,
    *,
    tp: int | None = None,
    ep: int | None = None,
    layout: bool = False,
    kv_dtype: str = "bf16",
    activation_reserve_gib: float = 8.0,
    workspace: plan.WorkspacePolicy = plan.WorkspacePolicy(),
) -> dict:
    """The inspect report as a JSON-ready dict. gpu_mem_gib defaults to one H200 (141 GiB). gpus: the even
    split's GPUs (default tp x ep, else 1); tp / ep: the split of the per-GPU plan ("split"; neither given:
    the best valid split of gpus); layout: also the fewest GPUs that hold one sequence of `context` tokens
    (default the model's max_position_embeddings; "layout")."""
    gpus, tp, ep = resolve_split(gpus, tp, ep)
    spec = path_or_spec if isinstance(path_or_spec, ModelSpec) else load_spec(path_or_spec)
    labels = [f"{layer.attention.kind}+{layer.mlp.kind}" for layer in spec.layers]
    attention_kinds = {}
    for layer in spec.layers:
        attention_kinds.setdefault(layer.attention.kind, layer.attention.to_dict())
    e = spec.experts
    experts = e.to_dict() if e is not None else {"num": 0, "top_k": 0, "format": None}
    if e is not None:
        experts["layers"] = sum(1 for layer in spec.layers if layer.mlp.experts is not None)
        experts["hash_routed_layers"] = [layer.index for layer in spec.layers if layer.mlp.kind == "hash_moe"]
    mem = plan.memory_plan(spec, gpus, gpu_mem_gib, context=context, kv_dtype=kv_dtype,
                           activation_reserve_gib=activation_reserve_gib, workspace=workspace)
    memory = mem.to_dict()
    memory["cache_by_attention_kind"] = _cache_by_kind(spec)
    plan_args = dict(gpu_mem_gib=gpu_mem_gib, kv_dtype=kv_dtype, activation_reserve_gib=activation_reserve_gib,
                     workspace=workspace)
    extra = {"split": _split_report(spec, gpus, tp, ep, context, plan_args)}
    if layout:
        extra["layout"] = _layout_report(spec, context, plan_args)
    ops = _ops_table(spec)
    return {
        "source": spec.source,
        "model_type": spec.model_type,
        "text_model_type": spec.text_model_type,
        "num_layers": spec.num_layers,
        "hidden_size": spec.hidden_size,
        "vocab_size": spec.vocab_size,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "mtp_layers": spec.mtp_layers,
        "layers": [{"index": layer.index, "attention": layer.attention.kind, "mlp": layer.mlp.kind,
                    "linear_format": layer.linear_format} for layer in spec.layers],
        "layer_runs": format_runs(compress_runs(labels)),
        "attention_kinds": attention_kinds,
        "mlp_activation": spec.layers[0].mlp.activation.to_dict() if spec.layers else None,
        "experts": experts,
        "weights": spec.quant.to_dict(),
        "cross_layer_residual": spec.cross_layer.to_dict(),
        "vision": spec.vision.to_dict() if spec.vision else None,
        "context": spec.context.to_dict(),
        "params_total": plan.total_params(spec),
        "params_active": plan.active_params(spec),
        "params_by_category": {k: v for k, v in plan.param_counts(spec).items() if v},
        "ops": ops,
        "ops_missing": [row["op"] for row in ops if not row["backends"]],
        "memory": memory,
        **extra,
    }


# -- text -----------------------------------------------------------------------------------------


def _table(header: list[str], rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: indent + "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return [line(header), line(["-" * w for w in widths])] + [line(r) for r in rows]


def _attention_summary(kind: str, a: dict) -> str:
    keys = ("num_heads", "num_kv_heads", "head_dim", "v_head_dim", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
            "sliding_window", "compress_ratio", "index_n_heads", "index_head_dim", "index_topk", "o_groups",
            "o_lora_rank", "conv_kernel", "gate_lower_bound", "output_gate")
    parts = [f"{k}={a[k]}" for k in keys if k in a]
    parts += [flag for flag in ("nope", "sinks", "bias", "qkv_bias", "qk_norm") if a.get(flag)]
    return f"{kind}: " + ", ".join(parts)


def format_report(report: dict) -> str:
    r = report
    ctx = r["context"]
    lines = [f"dayzero inspect: {r['source']}"]
    text_type = f" (text: {r['text_model_type']})" if r["text_model_type"] != r["model_type"] else ""
    lines.append(f"model_type {r['model_type']}{text_type}: {r['num_layers']} layers, hidden {r['hidden_size']}, "
                 f"vocab {r['vocab_size']}, max context {ctx['max_position_embeddings']}"
                 + (f" (rope {ctx.get('rope_type')} x{ctx.get('rope_factor')} from {ctx.get('original_max_position_embeddings')})"
                    if ctx.get("rope_factor") else ""))

    lines += ["", "Features"]
    features = [["attention", _attention_summary(k, a)] for k, a in r["attention_kinds"].items()]
    e = r["experts"]
    if e["num"]:
        rt = e["routing"]
        routing = rt["function"] + (" after top-k" if rt["softmax_after_topk"] else "")
        if rt["correction_bias"]:
            routing += " + correction bias"
        if rt["n_group"] > 1:
            routing += f", group-limited {rt['topk_group']}/{rt['n_group']}"
        if e["hash_routed_layers"]:
            routing += f"; hash-routed layers {e['hash_routed_layers']}"
        desc = (f"{e['num']} routed, top-{e['top_k']}, {e['num_shared']} shared, width {e['intermediate_size']}"
                + (f", latent {e['latent_dim']}" if e.get("latent_dim") else "") + f"; {e['layers']} MoE layers")
        features += [["experts", desc], ["routing", routing]]
    act = r["mlp_activation"] or {}
    features.append(["activation", ", ".join(f"{k}={v}" for k, v in act.items())])
    w = r["weights"]
    features.append(["weights", f"experts {w['expert_format']}, dense {w['dense_format']}"
                     + (f" (block {w['fp8_block']}, scales {w.get('scale_fmt')})" if w.get("fp8_block") else "")
                     + (f"; {w['note']}" if w.get("note") else "")])
    cl = r["cross_layer_residual"]
    features.append(["cross-layer", ", ".join(f"{k}={v}" for k, v in cl.items())])
    v = r["vision"]
    features.append(["vision", "none" if not v else
                     f"{v['kind']}: {v['num_layers']} layers, hidden {v['hidden_size']}, heads {v['num_heads']}, "
                     f"patch {v['patch_size']}, merge {v['merge_kernel'][0]}x{v['merge_kernel'][1]}"])
    lines += [f"  {name:<12} {text}" for name, text in features]

    lines += ["", "Layers (attention+mlp)"] + [f"  {run}" for run in r["layer_runs"]]

    lines += ["", "Parameters",
              f"  total {format_count(r['params_total'])}, active per token {format_count(r['params_active'])} "
              "(active = all but embedding table and routed experts, + top-k experts per MoE layer)"]
    cats = sorted(r["params_by_category"].items(), key=lambda kv: -kv[1])
    lines += [f"  {k:<18} {format_count(n)}" for k, n in cats]

    lines += ["", "Ops"]
    rows = [[row["op"], ", ".join(row["backends"]) or "MISSING", ", ".join(row["used_by"])] for row in r["ops"]]
    lines += _table(["op", "backends", "used by"], rows)
    missing = r["ops_missing"]
    lines.append(f"  {len(missing)} of {len(rows)} ops have no implementation" + (f": {', '.join(missing)}" if missing else ""))

    if r["split"]["gpus"] > 1 or not r["split"]["chosen"]:  # a split of GPUs, or --tp / --ep given
        lines += _format_split(r["split"])
    else:
        lines += _format_memory(r["memory"])
    if "layout" in r:
        lines += _format_layout(r["layout"])
    return "\n".join(lines)


def _format_memory(m: dict) -> list[str]:
    lines = ["", f"Memory plan: {m['gpus']} GPU(s) x {m['gpu_mem_gib']:.0f} GiB, KV {m['kv_dtype']}, one sequence"]
    fmt = ", ".join(f"{k} {format_gib(g)}" for k, g in m["weights_gib_by_format"].items())
    plan_rows = [
        ["weights (total)", format_gib(m['weights_gib']), fmt],
        ["weights per GPU", format_gib(m['weights_gib_per_gpu']), "split evenly"],
        ["expert workspace per GPU", format_gib(m['expert_workspace_gib_per_gpu']),
         f"FP8, {m['workspace_policy']['buffers']} buffer(s), <= top_k x {m['workspace_policy']['max_tokens_per_step']} tokens"],
        ["activation reserve per GPU", format_gib(m['activation_reserve_gib_per_gpu']), ""],
        ["free for cache per GPU", format_gib(max(0.0, m['free_for_cache_gib_per_gpu'])),
         "" if m['free_for_cache_gib_per_gpu'] >= 0 else
         f"none: the above exceed the GPU by {format_gib(-m['free_for_cache_gib_per_gpu'])}; more GPUs (--gpus)"],
        ["cache per token", format_bytes(m['cache_bytes_per_token']), "all layers"],
        ["bounded cache", format_gib(m['cache_fixed_gib']), "windows, compressor buffers, KDA / GDN state"],
        ["KDA / GDN state per request", format_gib(m['kda_state_gib_per_request']), "fp32 recurrent + bf16 conv"],
        ["longest context", f"{m['max_context_tokens']:,} tokens",
         f"limit {m['context_limit']:,} with max_position_embeddings"],
    ]
    if m.get("context") is not None:
        plan_rows.append([f"context {m['context']:,}", format_gib(m['context_cache_gib']) + " cache",
                          "fits" if m["context_fits"] else "does NOT fit"])
    lines += _table(["", "", ""], plan_rows)[2:]
    kind_rows = [[k, str(c["layers"]), f"{c['bytes_per_token_bf16']:.0f}", f"{c['bytes_per_token_fp8']:.0f}",
                  f"{c['fixed_bytes_bf16'] / 1024:.0f}", str(c["window"] or "-")] for k, c in m["cache_by_attention_kind"].items()]
    lines += ["", "  cache per layer, one sequence"]
    lines += _table(["kind", "layers", "B/token bf16", "B/token fp8", "bounded KiB bf16", "window"], kind_rows, "    ")
    return lines


CATEGORY_NOTES = {"attention": "heads over tp", "experts": "over ep", "mlp": "over tp", "vocabulary": "rows over tp",
                  "other": "norms, routers, mixers", "derived": "made at load"}


def _per_gpu_rows(p: dict) -> list[list[str]]:
    """The rows of one split's per-GPU plan (split_plan.RankPlan.to_dict)."""
    rows = [["weights", format_gib(p["weights_gib_per_gpu"]), ""]]
    for category, w in p["weights_by_category"].items():
        if not w["gib"]:
            continue
        whole = w["whole_gib"]
        note = ("whole on every GPU" if whole == w["gib"] else
                CATEGORY_NOTES[category] + (f", {format_gib(whole)} of it whole" if whole else ""))
        if category == "experts":
            note = f"{p['experts_per_gpu']} of {p['num_experts']} routed experts, {note}"
        rows.append([f"  {category}", format_gib(w["gib"]), note])
    free = p["free_for_cache_gib_per_gpu"]
    rows += [
        ["expert workspace", format_gib(p["expert_workspace_gib_per_gpu"]), "FP8 copies of its activated 4-bit experts (path B; none on sm_90)"],
        ["activation reserve", format_gib(p["activation_reserve_gib_per_gpu"]), ""],
        ["free for cache", format_gib(max(0.0, free)), "" if free >= 0 else
         f"none: the above exceed the GPU by {format_gib(-free)}; more GPUs (--gpus) or another split"],
        ["cache per token", format_bytes(p["cache_bytes_per_token_per_gpu"]), "this GPU's share, all layers"],
        ["bounded cache", format_gib(p["cache_fixed_gib_per_gpu"]), "one sequence: windows, compressor and KDA states"],
        ["longest context", f"{p['max_context_tokens']:,} tokens",
         f"one sequence; limit {p['context_limit']:,} with max_position_embeddings"],
    ]
    for tokens, n in p["sequences_at_context"].items():
        rows.append([f"KV capacity at {int(tokens):,}", "-" if n is None else f"{n:,} sequence(s)",
                     "past max_position_embeddings" if n is None else "at once"])
    if p.get("context") is not None:
        rows.append([f"context {p['context']:,}", format_gib(p["context_cache_gib"]) + " cache",
                     "fits" if p["context_fits"] else "does NOT fit"])
    return rows


def _others(others: list[dict], gpus: int) -> list[str]:
    """The other valid splits of the GPUs, one line each."""
    if not others:
        return []
    rows = [[f"tp {o['tp']} x ep {o['ep']}", format_gib(o["weights_gib_per_gpu"]) + " weights",
             format_gib(max(0.0, o["free_for_cache_gib_per_gpu"])) + " free",
             f"longest context {o['max_context_tokens']:,}"] for o in others]
    return [f"  other valid splits of {gpus} GPUs"] + _table(["", "", "", ""], rows, "    ")[2:]


def _format_split(split: dict) -> list[str]:
    p, gpus = split["plan"], split["gpus"]
    if p is None:
        lines = ["", f"Memory plan per GPU: no valid split of {gpus} GPUs"]
    else:
        how = ("as given" if not split["chosen"] else "the valid split with the longest context" if p["max_context_tokens"]
               else "no valid split leaves room for the cache; this one comes closest")
        lines = ["", f"Memory plan per GPU: tp {p['tp']} x ep {p['ep']} on {gpus} GPU{'s' * (gpus > 1)} x "
                     f"{p['gpu_mem_gib']:.0f} GiB ({how}), KV {p['kv_dtype']}"]
        lines += _table(["", "", ""], _per_gpu_rows(p))[2:]
        if split["refused_today"]:
            lines.append(f"  refused today: {split['refused_today']}")
        held = lambda c: "split over tp" if c["split"] else ("whole on every GPU" if p["tp"] > 1 else "-")  # noqa: E731
        kinds = [[k, str(c["layers"]), f"{c['bytes_per_token_per_gpu']:.0f}", f"{c['fixed_bytes_per_gpu'] / 1024:.0f}",
                  held(c)] for k, c in p["cache_by_attention_kind"].items()]
        lines += ["", "  cache per layer per GPU, one sequence"]
        lines += _table(["kind", "layers", "B/token", "bounded KiB", "held"], kinds, "    ")
    lines += _others(split["others"], gpus)
    if split["invalid"]:
        lines += [f"  invalid splits of {gpus} GPUs"] + [f"    {name}: {why}" for name, why in split["invalid"].items()]
    return lines


def _format_layout(layout: dict) -> list[str]:
    context = layout["context"]
    if layout["gpus"] is None:
        return ["", f"Layout: no split of up to {layout['max_gpus']} GPUs holds one sequence of {context:,} tokens"]
    p = layout["plan"]
    lines = ["", f"Layout: the fewest GPUs that hold one sequence of {context:,} tokens ({p['gpu_mem_gib']:.0f} GiB "
                 f"each, KV {p['kv_dtype']})",
             f"  {layout['gpus']} GPUs ({layout['nodes']} node(s) of {split_plan.GPUS_PER_NODE}), tp {layout['tp']} x "
             f"ep {layout['ep']}"]
    lines += _table(["", "", ""], _per_gpu_rows(p))[2:]
    if layout["refused_today"]:
        lines.append(f"  refused today: {layout['refused_today']}")
    return lines + _others(layout["alternatives"], layout["gpus"])
