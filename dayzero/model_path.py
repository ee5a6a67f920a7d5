"""The MODEL a user names (CLI argument, `LLM(model=...)`): a checkpoint directory or its config
file, resolved with errors that name the path and say what to give instead."""

from __future__ import annotations

import json
import os
from pathlib import Path


def read_json(path: Path) -> dict:
    """A JSON object from `path`; ValueError naming the file when it is not one."""
    try:
        value = json.loads(path.read_bytes())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text, so not a JSON config") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a JSON {type(value).__name__}, not an object of config fields")
    return value


def checkpoint_dir(model: str | os.PathLike) -> Path:
    """The checkpoint directory MODEL names: the directory itself (it must hold config.json), or the
    directory of a config.json path."""
    p = Path(model).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"model path {p} does not exist (give a checkpoint directory or its config.json)")
    if p.is_file():
        if p.name == "config.json":
            return p.parent
        raise FileNotFoundError(f"{p} is a file, not a checkpoint: give the directory that holds config.json and "
                                "the *.safetensors weights")
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{p} has no config.json: is it a Hugging Face checkpoint directory?")
    return p


def config_file(model: str | os.PathLike) -> Path:
    """The config file MODEL names for planning (`dayzero inspect`): a JSON file of any name, or a
    directory's config.json."""
    p = Path(model).expanduser()
    if p.is_file():
        return p
    return checkpoint_dir(p) / "config.json"
