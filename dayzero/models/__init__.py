"""Model files, one per family, registered by model_type; `load_model` builds one from a checkpoint.

A model file registers its class with `@register_model`; the class lists the model_types it
serves in `model_types`. Family modules are imported lazily (on first lookup), so that
`import dayzero` stays light.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import torch

from dayzero.models.base import CausalLM, WeightTarget
from dayzero.spec import ModelSpec, UnsupportedModelError, load_spec, resolve_config
from dayzero.startup import StartupTimer

# model file (module under dayzero.models) for each family; the module registers its classes on import
FAMILY_MODULES = ("deepseek_v3", "deepseek_v4", "gpt_oss", "kimi_linear", "kimi_k25", "glm4_moe", "qwen3_5_moe")

MODELS: dict[str, type[CausalLM]] = {}


def register_model(cls: type[CausalLM]) -> type[CausalLM]:
    for model_type in cls.model_types:
        if model_type in MODELS:
            raise ValueError(f"model_type {model_type!r} is already registered by {MODELS[model_type].__name__}")
        MODELS[model_type] = cls
    return cls


def _import_families() -> None:
    for name in FAMILY_MODULES:
        try:
            importlib.import_module(f"dayzero.models.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"dayzero.models.{name}":
                raise


def model_class(spec: ModelSpec) -> type[CausalLM]:
    _import_families()
    cls = MODELS.get(spec.model_type)
    if cls is None:
        raise UnsupportedModelError(
            "model_type", spec.model_type, tuple(sorted(MODELS)), spec.source or "config.json",
        )
    return cls


def read_config(path: str | Path) -> dict:
    path = Path(path)
    config_path = path / "config.json" if path.is_dir() else path
    return json.loads(config_path.read_text())


def load_model(path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
               progress: bool = True, verbose: bool = False, threads: int | None = None,
               startup: StartupTimer | None = None) -> CausalLM:
    """Build the model of the checkpoint at `path` and fill it from the safetensors files.

    Float weights are cast to `dtype`; FP8 and MXFP4 weights stay in their shipped format. The
    tensor names may be in any layout the model lists (`model.layouts()`: the release, what
    transformers saves); the one the checkpoint is in is found from its tensor names. Every
    mismatch between the checkpoint and what the model expects (missing, unexpected, wrong shape or
    dtype) is raised before any data is read, naming the tensor, the file and the layouts tried.
    The files are read by `threads` reader threads (default DAYZERO_LOAD_THREADS), each tensor once,
    into the model's own memory (dayzero.weights.fill). startup: the timer the phases are recorded in
    (config, model, checkpoint, weights, post_load); verbose prints them."""
    from dayzero.weights import Checkpoint, fill_targets, match_layout

    timer = startup if startup is not None else StartupTimer()
    device = torch.device(device)
    with timer.phase("config"):
        spec = load_spec(path)
        cls = model_class(spec)
        config = resolve_config(read_config(path))
    with timer.phase("model", detail=f"{spec.model_type}, {len(spec.layers)} layers"):
        model = cls(spec, config, dtype=dtype, device=device)  # parameters allocated, not filled
        targets = model.weight_targets()
    with timer.phase("checkpoint") as phase:  # headers, layout and schema; no tensor data yet
        expected = {name: t.spec for name, t in targets.items()}
        layout, checkpoint = match_layout(Checkpoint.open(path), model.layouts(), expected, family=spec.model_type,
                                          ignore_unexpected=model.ignore_patterns())
        phase.detail = f"{len(checkpoint.files)} file(s), {layout.name} layout"
    with timer.phase("weights") as phase:
        loaded = fill_targets(checkpoint, targets, device=device, threads=threads, progress=progress)
        phase.bytes = sum(loaded.bytes_by_dtype.values())
        phase.detail = (f"{loaded.num_tensors} tensors, {loaded.num_files} file(s), {loaded.threads} thread(s), "
                        f"to {device}")
    with timer.phase("post_load"):
        model.post_load()
        model.eval()
    if verbose:
        print(f"[dayzero] loaded {spec.model_type} to {device}: {timer.summary()}")
    return model


__all__ = ["CausalLM", "MODELS", "WeightTarget", "load_model", "model_class", "read_config", "register_model"]
