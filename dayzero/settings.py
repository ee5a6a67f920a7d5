"""Every DAYZERO_* environment variable, declared once: name, type, default and what it does.

The environment is read once, at the first `get()` (in practice at start-up, when the first op runs or
the first kernel is chosen), into a frozen `Settings`; nothing else in the package reads it. Tests
and benchmarks change settings in-process with `override(**fields)`, a context manager:

    with settings.override(moe_graph_max_tokens=0):
        ...

`reload()` reads the environment again (for a process that changed it on purpose). docs/settings.md
lists the settings; it is this module's `markdown_table()` (`python -m dayzero.settings` prints it,
and a test keeps the two equal). The one other environment the package reads is torchrun's
(`launcher_environment()`: RANK, WORLD_SIZE, LOCAL_RANK), which says how the process was started.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Mapping


def _text(env: str, raw: str) -> str | None:
    return raw.strip() or None


def _whole(env: str, raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{env} must be a whole number, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{env} must not be negative, got {value}")
    return value


def _gib(env: str, raw: str) -> float | None:
    if not raw.strip():
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{env} must be a number of GiB, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{env} must not be negative GiB, got {value}")
    return value


def _switch(env: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{env} must be 0 or 1, got {raw!r}")


def _path(env: str, raw: str) -> Path:
    return Path(raw).expanduser() if raw.strip() else Path.home() / ".cache" / "dayzero"


def _variants(env: str, raw: str) -> tuple[tuple[str, str], ...]:
    """"op=variant,op=variant" -> ((op, variant), ...), each op once."""
    pairs: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        op, sep, variant = (s.strip() for s in item.partition("="))
        if not sep or not op or not variant:
            raise ValueError(f"{env} must be op=variant pairs separated by commas (the variants `dayzero ops` "
                             f"lists), got {item!r} in {raw!r}")
        if op in pairs:
            raise ValueError(f"{env} names op {op!r} twice: {raw!r}")
        pairs[op] = variant
    return tuple(sorted(pairs.items()))


def _fault_plan(env: str, raw: str) -> str:
    from dayzero.engine.faults import parse_plan

    try:
        parse_plan(raw)
    except ValueError as exc:
        raise ValueError(f"{env}: {exc}") from None
    return raw.strip()


def setting(env: str, default, parse: Callable[[str, str], object], doc: str, shown: str | None = None):
    """A Settings field read from environment variable `env` by parse(env, raw); `doc` says what it
    does (one line); `shown`: the default as docs/settings.md prints it (default: repr of it)."""
    return field(default=default, metadata={"env": env, "parse": parse, "doc": doc,
                                            "shown": shown if shown is not None else repr(default)})


@dataclass(frozen=True)
class Settings:
    backend: str | None = setting(
        "DAYZERO_BACKEND", None, _text,
        "pin every op to one backend (`reference`, `triton`), so that paths can be measured against each other",
        shown="unset")
    variants: tuple[tuple[str, str], ...] = setting(
        "DAYZERO_VARIANT", (), _variants,
        "force kernel variants, `op=variant[,op=variant]` (e.g. `moe_experts_mxfp4=wgmma`); `dayzero ops` "
        "lists each op's variants; unset: the kernel library chooses per call", shown="unset")
    cache_dir: Path = setting(
        "DAYZERO_CACHE", Path.home() / ".cache" / "dayzero", _path,
        "where the demo checkpoint is built (`demo-v<N>/` inside it)", shown="`~/.cache/dayzero`")
    moe_graph_max_tokens: int = setting(
        "DAYZERO_MOE_GRAPH_MAX_TOKENS", 32, _whole,
        "eager routed-expert calls of up to this many tokens on CUDA replay a CUDA graph of the layer "
        "(kernels/moe/_graphs.py); 0 turns the graphs off")
    moe_b_min_tokens: int = setting(
        "DAYZERO_MOE_B_MIN_TOKENS", 512, _whole,
        "path B (MXFP4 experts as FP8 in the workspace) is chosen from this many tokens, where it can run "
        "(kernels/moe/choose.py)")
    moe_b_max_tokens: int = setting(
        "DAYZERO_MOE_B_MAX_TOKENS", 4096, _whole,
        "path B is chosen below this many tokens (from DAYZERO_MOE_B_MIN_TOKENS on)")
    fp8_workspace_gib: float | None = setting(
        "DAYZERO_FP8_WORKSPACE_GIB", None, _gib,
        "size of the FP8 expert workspace of path B where `LLM(fp8_workspace_gib=)` is not given; unset: every "
        "expert one step can activate; 0: none (path B off) (kernels/moe/choose.py: workspace_bytes)", shown="unset")
    fp8_prefetch: bool = setting(
        "DAYZERO_FP8_PREFETCH", True, _switch,
        "path B converts the experts the next layer used last time on a side stream, ahead of its call",
        shown="1")
    load_threads: int = setting(
        "DAYZERO_LOAD_THREADS", 0, _whole,
        "threads reading checkpoint files at load (dayzero/weights/fill.py); 0: min(8, CPU count); 1: one reader",
        shown="0")
    static_decode: bool = setting(
        "DAYZERO_STATIC_DECODE", False, _switch,
        "decode steps run the CUDA graphs' padded static step (dayzero/engine/graphs.py) eagerly where no graph "
        "is captured (the CPU, --no-cuda-graphs): to check the padding and the fixed buffers, every rank of a "
        "parallel job too", shown="0")
    max_image_pixels: int = setting(
        "DAYZERO_MAX_IMAGE_PIXELS", 50_000_000, _whole,
        "an image of more pixels (width x height, read from its header before decoding) is refused with a 400 "
        "(dayzero/multimodal/images.py)", shown="50000000")
    encoder_cache_tokens: int = setting(
        "DAYZERO_ENCODER_CACHE_TOKENS", 32768, _whole,
        "image features kept by the vision encoder's cache, in placeholder tokens (feature rows), least recently "
        "used first out; an image repeated within them is not encoded again (dayzero/multimodal/feature_cache.py)",
        shown="32768")
    pdl: bool = setting(
        "DAYZERO_PDL", True, _switch,
        "launch the decode layer's kernels with programmatic dependent launch (sm_90+; kernels/pdl.py)", shown="1")
    inject_faults: str = setting(
        "DAYZERO_INJECT_FAULTS", "", _fault_plan,
        "for tests: make engine steps fail, `oom@N` / `error@N` (the N-th step attempt) or `oom/N` / `error/N` "
        "(every N-th), comma-separated (dayzero/engine/faults.py); unset: none", shown="unset")

    def variant(self, op: str) -> str | None:
        """The variant DAYZERO_VARIANT forces for `op`, or None."""
        return next((variant for name, variant in self.variants if name == op), None)


def fields() -> tuple[dataclasses.Field, ...]:
    return dataclasses.fields(Settings)


def from_environ(environ: Mapping[str, str] | None = None) -> Settings:
    """Settings from `environ` (default os.environ): each set variable parsed, the rest defaults."""
    environ = os.environ if environ is None else environ
    values = {}
    for f in fields():
        raw = environ.get(f.metadata["env"])
        if raw is not None:
            values[f.name] = f.metadata["parse"](f.metadata["env"], raw)
    return Settings(**values)


TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def launcher_environment() -> dict[str, str]:
    """torchrun's variables that are set in this process's environment (parallel/launch.py reads them)."""
    return {name: os.environ[name] for name in TORCHRUN_VARIABLES if name in os.environ}


_stack: list[Settings] = []


def get() -> Settings:
    """The current settings: the environment's (read at the first call), or an override's."""
    if not _stack:
        _stack.append(from_environ())
    return _stack[-1]


def reload() -> Settings:
    """Read the environment again; drops nothing an active override() set (its exit restores it)."""
    fresh = from_environ()
    if _stack:
        _stack[0] = fresh
    else:
        _stack.append(fresh)
    return get()


@contextlib.contextmanager
def override(**changes) -> Iterator[Settings]:
    """Within the block, the current settings with `changes` (field names; checked)."""
    names = {f.name for f in fields()}
    unknown = sorted(set(changes) - names)
    if unknown:
        raise TypeError(f"unknown setting(s) {', '.join(unknown)}; settings: {', '.join(sorted(names))}")
    if "variants" in changes and isinstance(changes["variants"], Mapping):
        changes["variants"] = tuple(sorted(changes["variants"].items()))
    updated = dataclasses.replace(get(), **changes)
    _stack.append(updated)
    try:
        yield updated
    finally:
        for i in range(len(_stack) - 1, 0, -1):  # by identity: an equal Settings may sit below
            if _stack[i] is updated:
                del _stack[i]
                break


def markdown_table() -> str:
    """The settings as docs/settings.md lists them."""
    lines = ["| variable | default | what it does |", "|---|---|---|"]
    for f in fields():
        lines.append(f"| `{f.metadata['env']}` | {f.metadata['shown']} | {f.metadata['doc']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
