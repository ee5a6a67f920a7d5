"""The offline API: `LLM(model=PATH).generate(prompts, SamplingParams(...))`, `LLM.chat(messages)`,
`LLM.stream(prompt)`, over the engine core (dayzero/engine/engine.py). Every request of a call is
validated before any is queued: a bad one raises ValueError naming the value and nothing runs.

Prompts are text, token ids, or vLLM's dicts: {"prompt": text} or {"prompt_token_ids": ids}, with
"multi_modal_data": {"image": an image or a list of them} for a model that reads images (a PIL image,
bytes, a data: URL or a file:// path; one placeholder per image in the prompt, dayzero.multimodal).
`chat` takes image parts in messages (dayzero.multimodal.chat).
"""

from __future__ import annotations

import atexit
import itertools
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import torch

from dayzero.engine import tp_workers
from dayzero.parallel.launch import launch_of
from dayzero.parallel.state import check_expert_dispatch, set_expert_dispatch
from dayzero.engine.engine import Engine, eos_token_ids, load_tokenizer
from dayzero.engine.errors import InvalidRequestError
from dayzero.engine.sampling import SamplingParams, TokenLogprobs
from dayzero.engine.workspace import attach_expert_workspace
from dayzero.multimodal.chat import split_images
from dayzero.multimodal.images import ImageError
from dayzero.ops import REGISTRY
from dayzero.startup import StartupTimer

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string matched
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None  # finish_reason "error": why the engine step running it failed


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: dict = field(default_factory=dict)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission (vLLM's name)

    # the first completion's fields, for the common n=1 case
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


class LLM:
    def __init__(self, model: str | Path | None = None, *, device: str = "cpu", dtype: str = "float32",
                 max_num_seqs: int = 16, max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 block_size: int = 16, num_kv_blocks: int | None = None, kv_cache_gib: float | None = None,
                 mem_fraction: float | None = None, enable_prefix_caching: bool = True,
                 num_state_snapshots: int | None = None, kv_cache_dtype: str = "auto",
                 fp8_workspace_gib: float | None = None, seed: int = 0, progress: bool = False,
                 cuda_graphs: bool = True, enforce_eager: bool = False, load_threads: int | None = None,
                 async_scheduling: bool | None = None, tensor_parallel_size: int = 1,
                 expert_parallel_size: int = 1, expert_dispatch: str = "all_reduce", nnodes: int = 1, node_rank: int = 0,
                 dist_init_addr: str | None = None):
        """KV pool size, first that applies: num_kv_blocks; kv_cache_gib; mem_fraction (of the device's
        memory, or of RAM on CPU, minus the weights and a reserve); else every sequence at full length.
        enable_prefix_caching: reuse the cached blocks of earlier requests' prefixes (and, for models
        with recurrent state, num_state_snapshots saved states; default max_num_seqs).
        kv_cache_dtype: "auto" (the model's dtype) or "fp8_e4m3" (FP8 entries, a scale per 128 values).
        fp8_workspace_gib: the cross-layer FP8 expert workspace of path B (MXFP4 experts, where the kernel
        library can choose that path: kernels/moe/choose.py); default DAYZERO_FP8_WORKSPACE_GIB, else every
        expert one step can activate; 0: none.
        cuda_graphs: on CUDA, decode steps replay CUDA graphs captured per batch-size bucket where the model
        allows (dayzero.engine.graphs); False, or vLLM's enforce_eager=True, runs every step eagerly.
        load_threads: threads reading the checkpoint (default DAYZERO_LOAD_THREADS; 0: automatic).
        async_scheduling (vLLM's name): the host schedules and launches each step while the last one's
        sampled ids are still on their way (Engine._step_async); None (default): on CUDA, where the host
        work overlaps the GPU's (the CPU runs its ops synchronously: nothing to overlap).
        tensor_parallel_size (vLLM's name), expert_parallel_size: the model split over tp x ep processes, one
        per device (CUDA devices 0 .. n - 1, or the CPU with gloo), this one rank 0: attention and dense
        layers over tp, the routed experts over ep (dayzero.parallel.state, dayzero.engine.tp_workers);
        `close()` ends them. expert_dispatch: with ep > 1, "all_reduce" (every rank runs its experts on every
        token, the outputs summed) or "all_to_all" (each token's pairs sent to their experts' ranks and back):
        dayzero/parallel/dispatch.py. nnodes, node_rank, dist_init_addr (SGLang's names): the job over several nodes
        (dayzero.parallel.launch); under torchrun its environment says which rank this process is. A
        process that is not rank 0 runs its worker ranks here until rank 0 ends the job, then exits
        (SystemExit), so one script serves every node.
        Startup is timed phase by phase: `llm.startup` (a dayzero.startup.StartupTimer: .report(), .as_dict()),
        and its one-line summary is logged at INFO on the "dayzero.engine.llm" logger."""
        from dayzero.models import load_model

        timer = self.startup = StartupTimer()  # every phase below; llm.startup.report() shows them
        with timer.phase("locate"):  # the demo checkpoint is built here on its first use
            REGISTRY.check_variants()
            if dtype not in DTYPES:
                raise ValueError(f"dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
            if model is None:
                from dayzero.demo import demo_checkpoint

                model = demo_checkpoint()
            from dayzero.model_path import checkpoint_dir  # a missing path is an error naming it

            self.path = checkpoint_dir(model)
        self.workers = None
        for name, n in (("tensor_parallel_size", tensor_parallel_size), ("expert_parallel_size", expert_parallel_size)):
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {n!r}")
        tp, ep = tensor_parallel_size, expert_parallel_size
        check_expert_dispatch(expert_dispatch)
        launch = launch_of(nnodes, node_rank, dist_init_addr)
        if tp * ep > 1 or launch.nnodes > 1 or (launch.torchrun and launch.torchrun_world > 1):
            from dayzero.models import model_class
            from dayzero.spec import load_spec

            launch.check(tp * ep)
            spec = load_spec(self.path)  # refuse what the family cannot split before starting any process
            model_class(spec).check_parallel(spec.model_type, tp, ep)
            if not launch.is_rank0():
                raise SystemExit(tp_workers.run_ranks_here(tp, ep, device, launch))
            with timer.phase("ranks", detail=f"tp {tp} x ep {ep} processes"):
                self.workers = tp_workers.start(tp, ep, device, tp_workers.WorkerArgs(
                    str(self.path), DTYPES[dtype], kv_cache_dtype, fp8_workspace_gib, max_num_batched_tokens,
                    load_threads, expert_dispatch), launch)
                set_expert_dispatch(expert_dispatch)
            atexit.register(self.workers.close)
        try:
            self.model = load_model(self.path, device=device, dtype=DTYPES[dtype], progress=progress,
                                    threads=load_threads, startup=timer)  # config, model, checkpoint, weights, post_load
            with timer.phase("tokenizer"):
                self.tokenizer = load_tokenizer(self.path)
                eos = eos_token_ids(self.path, self.tokenizer)
                image_processor = None
                if self.model.spec.vision is not None and hasattr(self.model, "encode_images"):
                    from dayzero.multimodal.processor import ImageProcessor

                    image_processor = ImageProcessor.from_checkpoint(self.path, self.model.spec.vision)
            with timer.phase("workspace") as phase:
                self.expert_workspace = attach_expert_workspace(self.model, fp8_workspace_gib, max_num_batched_tokens)
                workspace_bytes = self.expert_workspace.capacity_bytes if self.expert_workspace is not None else 0
                phase.detail = "FP8 expert workspace, filled at first use" if workspace_bytes else "none"
                phase.bytes = workspace_bytes or None
            with timer.phase("engine"):  # the KV pool (its own phase), the runner, the scheduler, the sampler
                kv_cache_bytes = kv_cache_gib * 2**30 if kv_cache_gib is not None else None
                if kv_cache_bytes is None and mem_fraction is not None:
                    kv_cache_bytes = _kv_budget_from_fraction(self.model, mem_fraction, workspace_bytes)
                self.engine = Engine(self.model, self.tokenizer, eos_token_ids=eos,
                                     max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                     max_model_len=max_model_len, block_size=block_size, num_kv_blocks=num_kv_blocks,
                                     kv_cache_bytes=kv_cache_bytes, enable_prefix_caching=enable_prefix_caching,
                                     num_state_snapshots=num_state_snapshots, kv_cache_dtype=kv_cache_dtype, seed=seed,
                                     cuda_graphs=cuda_graphs and not enforce_eager, progress=progress, startup=timer,
                                     async_scheduling=async_scheduling, peers=self.workers,
                                     image_processor=image_processor)
            logger.info("%s", timer.summary())
            self.vocab_size = self.engine.vocab_size
            self.max_model_len = self.engine.max_model_len
            self._ids = itertools.count()
        except BaseException as exc:  # the workers wait on this rank: end them
            if self.workers is None or (failure := self.workers.abandon(exc)) is exc:
                raise
            raise failure from exc

    def close(self) -> None:
        """End the tensor-parallel workers (nothing to do in one process); the LLM cannot run after."""
        if self.workers is not None:
            self.workers.close()

    @property
    def scheduler(self):
        return self.engine.scheduler

    @property
    def runner(self):
        return self.engine.runner

    # -- public API -------------------------------------------------------------------------------
    def generate(self, prompts: str | Sequence[int] | dict | Sequence[str | Sequence[int] | dict],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for one prompt or a list (text, token ids, or a dict with images: module docstring);
        outputs in the prompts' order."""
        single = isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; give one, or one per prompt")
        checked = [self._prepare(p, sp, f"prompt {i}") for i, (p, sp) in enumerate(zip(prompts, params))]
        requests = []
        for prompt, (ids, sp, images) in zip(prompts, checked):
            rid = f"req-{next(self._ids)}"
            sub_ids = [f"{rid}-{i}" if sp.n > 1 else rid for i in range(sp.n)]
            for i, sub in enumerate(sub_ids):
                self.engine.add_request(sub, ids, sp, sample_index=i, images=images)
            text = prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, dict) else None
            requests.append((rid, text, ids, sub_ids))
        while self.engine.has_unfinished():
            self.engine.step()
        outputs = []
        for rid, text, ids, subs in requests:
            cached = self.engine.tracks[subs[0]].request.num_cached_tokens
            outputs.append(RequestOutput(rid, text, ids, [self._completion(i, sub) for i, sub in enumerate(subs)],
                                         num_cached_tokens=cached))
        return outputs

    def _prepare(self, prompt, params: SamplingParams, where: str):
        """(prompt ids, params, image placements) of one prompt, validated (Engine.validate, prepare_images)."""
        images = ()
        if isinstance(prompt, dict):
            unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"})
            if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
                raise ValueError(f"{where}: a dict prompt has one of 'prompt' (text) or 'prompt_token_ids', and "
                                 f"optionally 'multi_modal_data'; got keys {sorted(prompt)}")
            mm = prompt.get("multi_modal_data") or {}
            if not isinstance(mm, dict) or set(mm) - {"image"}:
                raise ValueError(f"{where}: multi_modal_data takes 'image' (an image or a list of images); got "
                                 f"{sorted(mm) if isinstance(mm, dict) else type(mm).__name__}")
            text = prompt.get("prompt", prompt.get("prompt_token_ids"))
            sources = mm.get("image")
            if sources is not None:
                sources = list(sources) if isinstance(sources, (list, tuple)) else [sources]
                prompt, images = self.engine.prepare_images(text, sources, where, "multi_modal_data.image")
            else:
                prompt = text
        ids, params = self.engine.validate(prompt, params, where)
        return ids, params, images

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Apply the checkpoint's chat template to one conversation (or a list) and generate. Message contents
        may hold image parts (dayzero.multimodal.chat), for a model that reads images."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for c in conversations:
            try:
                c, images = split_images(c, self.engine.image_placeholder, self.model.spec.model_type)
            except ImageError as exc:
                raise InvalidRequestError(str(exc), "messages") from None
            ids = self.apply_chat_template(c)
            prompts.append({"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images else ids)
        return self.generate(prompts, sampling_params)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None, **template_kwargs) -> list[int]:
        """The prompt ids of a conversation, by the checkpoint's chat template; tools (OpenAI function
        tools) and template_kwargs (e.g. the thinking switch) are passed to the template."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"{self.path} has no chat template (tokenizer_config.json chat_template)")
        ids = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                                 **template_kwargs)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def stream(self, prompt: str | Sequence[int] | dict, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Generate for one prompt, yielding text as it becomes final (a possible stop-string prefix
        is held back until it resolves). Abandoning the iterator aborts the request."""
        ids, sp, images = self._prepare(prompt, sampling_params or SamplingParams(), "prompt")
        if sp.n != 1:
            raise ValueError(f"stream generates one completion; got n={sp.n}")
        rid = f"req-{next(self._ids)}"
        self.engine.add_request(rid, ids, sp, images=images)
        done = False
        try:
            while not done:
                for update in self.engine.step():
                    if update.request_id != rid:
                        continue
                    done = update.finished
                    if update.text_delta:
                        yield update.text_delta
        finally:
            if done:
                self.engine.pop_finished(rid)
            else:
                self.engine.abort(rid)

    def _completion(self, index: int, request_id: str) -> CompletionOutput:
        track = self.engine.pop_finished(request_id)
        req = track.request
        logprobs = track.logprobs if req.sampling_params.logprobs is not None else None
        return CompletionOutput(index, track.final_text, list(req.output_token_ids), req.finish_reason,
                                req.stop_reason, logprobs, track.error)


RESERVE_FRACTION = 0.05  # of the device's memory, kept for activations, allocator slack and the runtime


def _kv_budget_from_fraction(model, mem_fraction: float, workspace: int) -> float:
    """mem_fraction of the device's memory (RAM on CPU) minus the weights, a reserve and the FP8 expert
    workspace (attach_expert_workspace), in bytes."""
    import os

    if not 0 < mem_fraction <= 1:
        raise ValueError(f"mem_fraction must be in (0, 1], got {mem_fraction}")
    device = model.device_
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    weights = sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))
    budget = mem_fraction * total - weights - workspace - RESERVE_FRACTION * total
    if budget <= 0:
        raise ValueError(f"mem_fraction {mem_fraction} of {total / 2**30:.1f} GiB leaves nothing for the KV cache after "
                         f"{weights / 2**30:.2f} GiB of weights, {workspace / 2**30:.2f} GiB of FP8 expert workspace "
                         f"(fp8_workspace_gib, DAYZERO_FP8_WORKSPACE_GIB) and a {RESERVE_FRACTION:.0%} reserve; raise it")
    return budget
