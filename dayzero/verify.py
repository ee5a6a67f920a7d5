"""`dayzero verify`: the day-0 acceptance check of a checkpoint against transformers, whose two
paths are checked against each other too.

Both sides load the same checkpoint. dayzero prefills a random prompt and decodes greedily with its
cache. transformers runs the same tokens (the prompt, then dayzero's greedy tokens) two ways:
    cached  its `generate` with its cache, every step's token forced to dayzero's, the raw logits
            of every step kept (output_logits);
    full    one forward over the final sequence without a cache: the model is causal, so the
            logits at position p (which depend on tokens <= p only) are the logits of the step that
            predicts token p + 1.
The two compute the same model and must agree; where they differ beyond the tolerance, the report
says "the reference is inconsistent at step k". dayzero is judged against the full forward (the
oracle: no cache, no decoding code, the definition evaluated directly), and the report names it.
Each step's error is max |ours - theirs| / max |theirs| over that step's logits (the prefill step:
every prompt position against the full forward, the last one against the cached path); the first
step whose error passes the tolerance, or whose greedy token differs from the oracle's, is the
first divergence.

Images (vision-language models, `images=` / `--image FILE`). The prompt holds every image's placeholder
tokens among the random ones (image i after the i-th of len(images) + 1 equal parts of the prompt), as
dayzero's preprocessing expands them (dayzero.multimodal); both sides read the same pixels: dayzero
through its own encoder and feature merge, transformers through `pixel_values` / `image_grid_thw` in its
generate and its full forward.

Top-k ties (DeepSeek-V3.2). The lightning indexer's scores tie exactly where ReLU zeros every head
(common with few indexer heads), and `torch.topk`'s pick among tied scores depends on the row length
it is given, so transformers' full forward (rows padded by the causal mask to the whole sequence)
and its cached decode (rows of exactly the visible keys) select different keys and their logits
differ by tens of percent. The definition leaves ties open; dayzero ranks them by key index
(dayzero.ops.dsa). By default the reference's DSA top-k gets the same rule (`ties="index"`), which
makes its two paths agree; `ties="torch"` runs transformers as installed.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from dayzero.ops.dsa import ranked_topk
from dayzero.spec import load_spec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Default tolerance on the max relative logits error, per dtype: float32 is held to the issue's
# 1e-4; bfloat16 keeps 8 bits of mantissa, so two implementations legitimately differ by ~1e-2.
DEFAULT_TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}


ORACLE = "transformers full forward (no cache)"
# How the reference's DSA top-k breaks exact score ties: "index" = dayzero's rule (equal scores by
# ascending key index, dayzero.ops.dsa.ranked_topk), "torch" = transformers as installed.
REFERENCE_TIES = ("index", "torch")
# Per model_type, the transformers modules whose torch.topk selects DSA keys (where the rule applies)
DSA_TOPK_MODULES = {"deepseek_v32": ("DeepseekV32Indexer",), "deepseek_v4": ("DeepseekV4Indexer",)}


@dataclass
class StepResult:
    step: int  # 0 = prefill, k = k-th decode step
    rel_err: float  # against the oracle (the full forward): rel_err_vs_full
    token: int  # dayzero's greedy token after this step
    reference_token: int  # the oracle's greedy token after this step
    rel_err_vs_full: float
    rel_err_vs_cached: float  # against transformers' cached generate (prefill: the last prompt position)
    reference_rel_err: float  # transformers' cached generate against its full forward
    cached_token: int  # transformers' cached generate's greedy token after this step


@dataclass
class VerifyResult:
    model_type: str
    dtype: str
    tolerance: float
    prompt_ids: list[int]
    greedy_tokens: list[int]  # dayzero's greedy continuation: decode_steps + 1 tokens
    reference_tokens: list[int]  # the oracle's argmax at the same positions (teacher-forced on ours)
    decode_steps: int
    oracle: str  # what rel_err, reference_tokens and the verdict are against
    reference_ties: str  # the DSA top-k tie rule the reference ran with (REFERENCE_TIES)
    prefill_rel_err: float
    decode_rel_err: list[float]
    max_rel_err: float
    tokens_match: bool
    passed: bool
    first_divergence: dict | None
    reference_consistent: bool  # transformers' cached generate agrees with its full forward at every step
    reference_inconsistency: dict | None  # the first step where they do not
    steps: list[StepResult] = field(default_factory=list)
    seconds: dict = field(default_factory=dict)
    tp: int = 1  # dayzero's side split over tp x ep processes
    ep: int = 1
    num_images: int = 0  # images in the prompt (their placeholder tokens are in prompt_ids)

    def to_dict(self) -> dict:
        return asdict(self)


def rel_err(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    ours, theirs = ours.double(), theirs.double()
    return float((ours - theirs).abs().max() / theirs.abs().max().clamp_min(1e-30))


def load_dayzero(path: str | Path, dtype: torch.dtype, device: str):
    from dayzero.models import load_model

    return load_model(path, dtype=dtype, device=device, progress=False)


VISION_MODEL_TYPES = ("kimi_k25",)  # transformers builds them as image-text-to-text models
# model_types that transformers does not know under their own name, and the type it implements them as
# (Kimi-K2 checkpoints say kimi_k2 and ship remote code; the architecture is DeepSeek-V3's)
REFERENCE_ALIASES = {"kimi_k2": "deepseek_v3"}


def reference_load_kwargs(config: dict) -> dict:
    """from_pretrained arguments for transformers' model of a checkpoint with `config`: MXFP4 experts
    dequantized on load (the format's definition; transformers >= 5.25 would otherwise fetch its Triton
    MXFP4 kernels from the Hub when the `kernels` package is installed, and this code never downloads)."""
    if (config.get("quantization_config") or {}).get("quant_method") == "mxfp4":
        from transformers import Mxfp4Config

        return {"quantization_config": Mxfp4Config(dequantize=True)}
    return {}


def _dayzero_steps(model, prompt: torch.Tensor, decode_steps: int, images=None) -> tuple[list[torch.Tensor], list[int]]:
    """Prefill, then greedy decode steps: step 0's logits of every prompt position [P, V], then [V] per step.
    images: the prompt's ImageInputs, encoded by the model and merged at its placeholders."""
    device, prompt_len = prompt.device, prompt.shape[1]
    cache = model.new_cache(batch=1)
    positions = torch.arange(prompt_len, device=device)[None]
    if images:
        features = model.encode_images(torch.cat([im.pixels for im in images]), tuple(im.grid for im in images))
        steps = [model(prompt, positions, cache, image_features=torch.cat(features))[0]]
    else:
        steps = [model(prompt, positions, cache)[0]]
    tokens = [int(steps[0][-1].argmax())]
    for k in range(1, decode_steps + 1):
        last = torch.tensor([[tokens[-1]]], device=device)
        pos = torch.tensor([[prompt_len + k - 1]], device=device)
        steps.append(model(last, pos, cache)[0, -1])
        tokens.append(int(steps[-1].argmax()))
    return steps, tokens


def _rank_steps(rank: int, tp: int, ep: int, init: str, path: str, dtype: torch.dtype, device: str,
                prompt: torch.Tensor, decode_steps: int):
    """One rank of a split run: join, load its shard, run the steps (the gathered logits, alike on every rank)."""
    from dayzero.parallel import init_process, shutdown

    init_process(tp, ep, rank, init, device)
    try:
        model = load_dayzero(path, dtype, device)
        with torch.no_grad():
            steps, tokens = _dayzero_steps(model, prompt.to(device), decode_steps)
        return model.spec.model_type, steps, tokens
    finally:
        shutdown()


def run_dayzero(path: str | Path, dtype: torch.dtype, device: str, prompt: torch.Tensor, decode_steps: int,
                tp: int = 1, ep: int = 1, images=None) -> tuple[str, list[torch.Tensor], list[int]]:
    """dayzero's side: (model type, step logits, greedy tokens), in this process or split over tp x ep."""
    if tp * ep == 1:
        model = load_dayzero(path, dtype, device)
        with torch.no_grad():
            steps, tokens = _dayzero_steps(model, prompt, decode_steps, images)
        return model.spec.model_type, steps, tokens
    if images:
        raise ValueError("--image runs dayzero in one process; drop --tp / --ep")
    import torch.multiprocessing as mp

    from dayzero.engine.tp_workers import free_port
    from dayzero.models import model_class
    from dayzero.parallel.launch import Launch

    spec = load_spec(path)
    model_class(spec).check_parallel(spec.model_type, tp, ep)  # refused before any process starts
    init, kind, launch = f"tcp://127.0.0.1:{free_port()}", torch.device(device).type, Launch()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_steps, daemon=True, args=(r, tp, ep, init, str(path), dtype,
                         launch.device(kind, r, tp * ep), prompt.cpu(), decode_steps)) for r in range(1, tp * ep)]
    for proc in procs:
        proc.start()
    try:
        out = _rank_steps(0, tp, ep, init, str(path), dtype, launch.device(kind, 0, tp * ep), prompt, decode_steps)
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.terminate()
    bad = [f"rank {r + 1} exited with code {proc.exitcode}" for r, proc in enumerate(procs) if proc.exitcode]
    if bad:
        raise RuntimeError(f"the split run failed: {'; '.join(bad)}")
    return out


def load_reference(path: str | Path, dtype: torch.dtype, device: str, dequantize: bool | None = None,
                   ties: str = "index"):
    """transformers' model of the checkpoint, its DSA top-k ties broken by `ties` (REFERENCE_TIES,
    `rank_reference_ties`). FP8 block-quantized checkpoints in the Hugging Face
    layout (DeepSeek-V3 / V3.2 / Kimi-K2) are handed to transformers as weights dequantized by dayzero.formats.fp8 (tested
    against torch's float8 dtypes) when `dequantize` is True, or by default when transformers' own
    loader cannot be trusted with them: on a GPU it needs the `kernels` package from the Hub, and on
    CPU it derives the block size from the scale grid, which is wrong for any dim that is not a
    multiple of the block (a real kv_a_proj_with_mqa has 576 rows)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    if ties not in REFERENCE_TIES:
        raise ValueError(f"--reference-ties {ties!r} is not supported; choose one of {', '.join(REFERENCE_TIES)}")
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    config.pop("auto_map", None)
    model_type = REFERENCE_ALIASES.get(config.get("model_type"), config.get("model_type"))
    text_config = config.get("text_config") or {}  # a vision-language wrapper's language model
    quant = config.get("quantization_config") or text_config.get("quantization_config") or {}
    fp8 = quant.get("quant_method") == "fp8" and _has_scale_inv(path)
    if dequantize is None:
        dequantize = fp8 and (torch.device(device).type != "cpu" or not _fp8_blocks_divide(path, quant))
    if dequantize and not fp8:
        raise ValueError(f"{path}: dequantize=True needs an FP8 block-quantized checkpoint "
                         f"(quant_method 'fp8', weights with weight_scale_inv)")
    if dequantize:
        config.pop("quantization_config", None)
        text_config.pop("quantization_config", None)
    reference_config = AutoConfig.for_model(model_type, **{k: v for k, v in config.items() if k != "model_type"})
    auto = AutoModelForImageTextToText if model_type in VISION_MODEL_TYPES else AutoModelForCausalLM
    if dequantize:
        cls = auto._model_mapping[type(reference_config)]
        model = cls.from_pretrained(None, config=reference_config, state_dict=_dequantized_state_dict(path, quant, dtype),
                                    dtype=dtype)
    elif model_type != config.get("model_type"):
        model = AutoModelForCausalLM.from_pretrained(path, config=reference_config, dtype=dtype,
                                                     **reference_load_kwargs(config))
    else:
        model = auto.from_pretrained(path, dtype=dtype, **reference_load_kwargs(config))
    if ties == "index":
        rank_reference_ties(model, model_type)
    if dtype == torch.float32:  # every tensor float32 (transformers < 5.25 dequantizes MXFP4 experts to bf16)
        model = model.float()
    return model.to(device).eval()


class _RankedTopk(TorchFunctionMode):
    """torch.topk / Tensor.topk computed as dayzero.ops.dsa.ranked_topk: equal values by ascending
    index, whatever the row length."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.topk or func is torch.Tensor.topk:
            return _ranked_topk_call(*args, **kwargs)
        return func(*args, **kwargs)


def _ranked_topk_call(input: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
    if not largest:
        raise NotImplementedError("the reference's DSA tie rule covers topk(largest=True) only")
    values, indices = ranked_topk(input.movedim(dim, -1), k)
    return torch.return_types.topk((values.movedim(-1, dim), indices.movedim(-1, dim)))


def rank_reference_ties(model: torch.nn.Module, model_type: str) -> int:
    """Make the top-k of the transformers modules that select DSA keys (DSA_TOPK_MODULES[model_type])
    rank equal scores by key index, as dayzero does; every other computation is untouched, and
    where no scores tie the result is the one transformers gives as installed. Returns how many
    modules were changed (0 for a model_type without DSA)."""
    names = DSA_TOPK_MODULES.get(model_type, ())
    changed = 0
    for module in model.modules():
        if type(module).__name__ in names:
            forward = module.forward

            def ranked_forward(*args, _forward=forward, **kwargs):
                with _RankedTopk():
                    return _forward(*args, **kwargs)

            module.forward = ranked_forward
            changed += 1
    if names and not changed:
        raise RuntimeError(f"transformers' {model_type} model has no {' / '.join(names)} module: the DSA top-k "
                           f"tie rule cannot be applied (use ties='torch' / --reference-ties torch)")
    return changed


def _has_scale_inv(path: Path) -> bool:
    """The Hugging Face FP8 layout (DeepSeek-V3 / V3.2 / Kimi-K2): scales named weight_scale_inv.
    DeepSeek-V4's original layout (`.scale`) goes through transformers' own conversion."""
    from dayzero.weights import Checkpoint

    return any(name.endswith("weight_scale_inv") for name in Checkpoint.open(path).tensors)


def _fp8_blocks_divide(path: Path, quant: dict) -> bool:
    """Every FP8 weight's dims are multiples of the checkpoint's weight_block_size."""
    from dayzero.weights import Checkpoint

    block = quant.get("weight_block_size") or (128, 128)
    return all(info.torch_shape[-2] % block[0] == 0 and info.torch_shape[-1] % block[1] == 0
               for info in Checkpoint.open(path).tensors.values() if info.dtype == "F8_E4M3")


def _dequantized_state_dict(path: Path, quant: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor in `dtype`, FP8 weights times their weight_scale_inv blocks."""
    from dayzero.formats.fp8 import dequantize_weight_blocks
    from dayzero.weights import iter_tensors

    block = tuple(quant.get("weight_block_size") or (128, 128))
    raw = dict(iter_tensors(path, progress=False))
    out = {}
    for name, t in raw.items():
        if name.endswith("weight_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            scale = raw.get(name + "_scale_inv")
            if scale is None:
                raise ValueError(f"{path}: FP8 tensor {name} has no {name}_scale_inv")
            out[name] = dequantize_weight_blocks(t, scale, block, dtype)
        else:
            out[name] = t.to(dtype) if t.is_floating_point() else t
    return out


class _ForceTokens:
    """A `generate` logits processor that makes step k emit tokens[k] (the raw logits, which
    output_logits returns, are untouched)."""

    def __init__(self, tokens: list[int], prompt_len: int):
        self.tokens, self.prompt_len = tokens, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        forced = torch.full_like(scores, float("-inf"))
        forced[:, self.tokens[input_ids.shape[1] - self.prompt_len]] = 0.0
        return forced


def reference_image_inputs(images) -> dict:
    """transformers' image arguments (pixel_values, image_grid_thw) of the prompt's ImageInputs; {} for none."""
    if not images:
        return {}
    return {"pixel_values": torch.cat([im.pixels for im in images]),
            "image_grid_thw": torch.tensor([list(im.grid) for im in images])}


def reference_cached_logits(model, prompt: torch.Tensor, tokens: list[int], **inputs) -> torch.Tensor:
    """transformers' cached `generate` over prompt [1, P] emitting `tokens` (forced): the raw
    logits of every step, float32 [len(tokens), vocab]. The model's own generation config (EOS,
    sampling, penalties) is set aside so that nothing stops or alters the run. inputs: more model
    arguments (reference_image_inputs)."""
    from transformers import GenerationConfig, LogitsProcessorList

    steps = len(tokens)
    saved = model.generation_config
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    try:
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=steps, min_new_tokens=steps,
                             do_sample=False, use_cache=True, output_logits=True, return_dict_in_generate=True,
                             logits_processor=LogitsProcessorList([_ForceTokens(tokens, prompt.shape[1])]), **inputs)
    finally:
        model.generation_config = saved
    if out.sequences[0, prompt.shape[1]:].tolist() != tokens:
        raise RuntimeError(f"transformers' generate did not follow the forced tokens {tokens}: "
                           f"{out.sequences[0, prompt.shape[1]:].tolist()}")
    return torch.cat([step.float() for step in out.logits], dim=0)


@contextlib.contextmanager
def _full_precision(dtype: torch.dtype, model_type: str):
    """float32 on CUDA without TF32 on either side (cuDNN's convolutions, the patch embedding and the short
    convolutions, use TF32 by default: a 5e-4 relative error in transformers' own float32 forward), and
    transformers' torch definitions of the functions it takes from an installed kernel package instead
    (`use_kernel_func_from_hub_with_fallback`: fla's chunk_kda / chunk_gated_delta_rule, whose products run
    in TF32: Kimi Linear's and Qwen3.5's float32 references were 8e-4 and 2e-3 off on an H100 with fla-core)."""
    if dtype != torch.float32:
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    swaps = _torch_definitions(model_type)
    for module, name, _, definition in swaps:
        setattr(module, name, definition)
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
        for module, name, wrapped, _ in swaps:
            setattr(module, name, wrapped)


def _torch_definitions(model_type: str) -> list:
    """(module, name, the function, its torch definition) for each function of transformers' modeling module
    of `model_type` that wraps a torch definition (functools.wraps: `__wrapped__`, defined in that module)."""
    import importlib
    import inspect

    name = {**REFERENCE_ALIASES, "qwen3_5_moe_text": "qwen3_5_moe"}.get(model_type, model_type)
    try:
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    except ImportError:
        return []
    out = []
    for attr, fn in list(vars(module).items()):
        inner = getattr(fn, "__wrapped__", None)
        if inspect.isfunction(fn) and inspect.isfunction(inner) and inner.__module__ == module.__name__:
            out.append((module, attr, fn, inner))
    return out


def _both_sides(path, torch_dtype, device, prompt, decode_steps, tp, ep, image_inputs, reference_ties, seconds):
    """dayzero's steps, then transformers' (cached generate and full forward) over the same tokens."""
    started = time.perf_counter()
    model_type, our_steps, tokens = run_dayzero(path, torch_dtype, device, prompt, decode_steps, tp, ep, image_inputs)
    seconds["dayzero"] = time.perf_counter() - started  # its load included
    started = time.perf_counter()
    theirs = load_reference(path, torch_dtype, device, ties=reference_ties)
    seconds["load_transformers"] = time.perf_counter() - started

    started = time.perf_counter()
    image_args = {k: v.to(device) for k, v in reference_image_inputs(image_inputs).items()}
    if "pixel_values" in image_args:
        image_args["pixel_values"] = image_args["pixel_values"].to(torch_dtype)
    cached = reference_cached_logits(theirs, prompt, tokens, **image_args)
    seconds["transformers_cached"] = time.perf_counter() - started
    started = time.perf_counter()
    sequence = torch.cat([prompt, torch.tensor([tokens[:-1]], dtype=prompt.dtype, device=device)], dim=1)
    full = theirs(input_ids=sequence, use_cache=False, **image_args).logits[0].float()  # position p predicts token p + 1
    seconds["transformers_full"] = time.perf_counter() - started

    return model_type, our_steps, tokens, cached, full


@torch.no_grad()
def verify_checkpoint(path: str | Path, *, prompt_len: int = 32, decode_steps: int = 8, seed: int = 0,
                      dtype: str = "float32", device: str = "cpu", tolerance: float | None = None,
                      reference_ties: str = "index", tp: int = 1, ep: int = 1, images=()) -> VerifyResult:
    """tp / ep: dayzero's side split over tp x ep processes (dayzero.parallel; gloo on the CPU, NCCL on
    CUDA devices 0 ..), its logits gathered on rank 0, this process. images: image files (or anything
    dayzero.multimodal.images.load_image takes) placed in the prompt (module docstring)."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
    if prompt_len < 1:
        raise ValueError(f"--prompt-len must be at least 1, got {prompt_len}")
    if decode_steps < 0:
        raise ValueError(f"--decode-steps must be >= 0, got {decode_steps}")
    if reference_ties not in REFERENCE_TIES:
        raise ValueError(f"--reference-ties {reference_ties!r} is not supported; choose one of {', '.join(REFERENCE_TIES)}")
    tol = DEFAULT_TOLERANCE[dtype] if tolerance is None else tolerance
    torch_dtype = DTYPES[dtype]
    seconds = {}

    spec = load_spec(path)
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, spec.vocab_size, (1, prompt_len), generator=gen)
    image_inputs = None
    if images:
        prompt, image_inputs = _prompt_with_images(path, spec, prompt, list(images))
        prompt_len = prompt.shape[1]
    prompt = prompt.to(device)
    with _full_precision(torch_dtype, spec.model_type):
        model_type, our_steps, tokens, cached, full = _both_sides(
            path, torch_dtype, device, prompt, decode_steps, tp, ep, image_inputs, reference_ties, seconds)

    steps = []
    for k, our in enumerate(our_steps):
        oracle = full[:prompt_len] if k == 0 else full[prompt_len - 1 + k]
        last_ours = our[-1] if k == 0 else our
        err_full = rel_err(our, oracle)
        steps.append(StepResult(
            step=k, rel_err=err_full, token=tokens[k], reference_token=int(full[prompt_len - 1 + k].argmax()),
            rel_err_vs_full=err_full, rel_err_vs_cached=rel_err(last_ours, cached[k]),
            reference_rel_err=rel_err(cached[k], full[prompt_len - 1 + k]), cached_token=int(cached[k].argmax())))

    inconsistent = next((s for s in steps if s.reference_rel_err > tol), None)
    inconsistency = None
    if inconsistent is not None:
        inconsistency = {
            "step": inconsistent.step,
            "rel_err": inconsistent.reference_rel_err,
            "cached_token": inconsistent.cached_token,
            "full_token": inconsistent.reference_token,
            "message": f"the reference is inconsistent at step {inconsistent.step}: transformers' cached generate and "
                       f"its full forward differ by {inconsistent.reference_rel_err:.3e} relative logits error "
                       f"(tolerance {tol:.1e}; greedy token {inconsistent.cached_token} vs "
                       f"{inconsistent.reference_token}); dayzero is judged against the full forward",
        }
    first = next((s for s in steps if s.rel_err > tol or s.token != s.reference_token), None)
    divergence = None
    if first is not None:
        what = "prefill" if first.step == 0 else f"decode step {first.step}"
        divergence = {
            "step": first.step,
            "what": what,
            "rel_err": first.rel_err,
            "token": first.token,
            "reference_token": first.reference_token,
            "message": f"first divergence at {what}: max relative logits error {first.rel_err:.3e} against {ORACLE} "
                       f"(tolerance {tol:.1e}); greedy token {first.token} vs transformers {first.reference_token}",
        }
    errors = [s.rel_err for s in steps]
    return VerifyResult(
        model_type=model_type,
        tp=tp,
        ep=ep,
        num_images=len(image_inputs or ()),
        dtype=dtype,
        tolerance=tol,
        prompt_ids=prompt[0].tolist(),
        greedy_tokens=tokens,
        reference_tokens=[s.reference_token for s in steps],
        decode_steps=decode_steps,
        oracle=ORACLE,
        reference_ties=reference_ties,
        prefill_rel_err=errors[0],
        decode_rel_err=errors[1:],
        max_rel_err=max(errors),
        tokens_match=all(s.token == s.reference_token for s in steps),
        passed=first is None,
        first_divergence=divergence,
        reference_consistent=inconsistency is None,
        reference_inconsistency=inconsistency,
        steps=steps,
        seconds={k: round(v, 3) for k, v in seconds.items()},
    )


def _prompt_with_images(path, spec, prompt: torch.Tensor, sources: list):
    """(the random prompt [1, P'] with every image's expanded placeholders, the ImageInputs): image i
    after the i-th of len(sources) + 1 equal parts; the random tokens avoid the model's media token ids."""
    from dayzero.models import model_class, read_config
    from dayzero.multimodal.images import load_image
    from dayzero.multimodal.placeholders import place_images
    from dayzero.multimodal.processor import ImageProcessor
    from dayzero.spec import resolve_config

    if spec.vision is None or not hasattr(model_class(spec), "encode_images"):
        raise ValueError(f"--image needs a model that reads images; {spec.model_type} has no vision tower dayzero runs")
    config = resolve_config(read_config(path))
    media = {int(config.get("image_token_id", 163605)), int(config.get("video_token_id", 163840))}
    ids = [t if t not in media else (t + 1) % spec.vocab_size for t in prompt[0].tolist()]
    processor = ImageProcessor.from_checkpoint(path, spec.vision)
    images = [processor.preprocess(load_image(src, f"--image {src}")) for src in sources]
    token = int(config.get("image_token_id", 163605))
    cut = [len(ids) * (i + 1) // (len(images) + 1) for i in range(len(images))]
    marked = []
    for i, t in enumerate(ids):
        marked += [token] * cut.count(i) + [t]
    ids, _ = place_images(marked, images, token)
    return torch.tensor([ids]), images


def format_result(r: VerifyResult) -> str:
    ties = ", DSA top-k ties by key index" if r.reference_ties == "index" and r.model_type in DSA_TOPK_MODULES else ""
    split = f", dayzero over tp {r.tp} x ep {r.ep} processes" if r.tp * r.ep > 1 else ""
    images = f" ({r.num_images} image(s))" if r.num_images else ""
    lines = [f"dayzero verify: {r.model_type}, {r.dtype}, prompt {len(r.prompt_ids)} tokens{images}, {r.decode_steps} "
             f"decode steps{split}",
             f"  oracle: {r.oracle}{ties}; checked against transformers' cached generate (cached-full)",
             f"  {'step':<10} {'vs full':>10} {'vs cached':>10} {'cached-full':>12}  {'dayzero':>7} {'transformers':>12}"]
    for s in r.steps:
        name = "prefill" if s.step == 0 else f"decode {s.step}"
        flag = "" if s.rel_err <= r.tolerance and s.token == s.reference_token else "  <-- diverges"
        if s.reference_rel_err > r.tolerance:
            flag += "  <-- reference inconsistent"
        lines.append(f"  {name:<10} {s.rel_err_vs_full:>10.3e} {s.rel_err_vs_cached:>10.3e} {s.reference_rel_err:>12.3e}"
                     f"  {s.token:>7} {s.reference_token:>12}{flag}")
    lines.append(f"  max relative error {r.max_rel_err:.3e} against the full forward (tolerance {r.tolerance:.1e}); "
                 "greedy tokens " + ("match" if r.tokens_match else "DIFFER"))
    lines.append("  " + ("the reference is consistent: its cached generate and full forward agree at every step"
                         if r.reference_consistent else r.reference_inconsistency["message"]))
    lines.append("PASSED" if r.passed else f"FAILED: {r.first_divergence['message']}")
    return "\n".join(lines)
