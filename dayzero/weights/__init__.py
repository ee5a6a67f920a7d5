"""Loading Hugging Face safetensors checkpoints: catalogue, schema check, streaming.

    ckpt = Checkpoint.open("path/to/model")        # headers only: ckpt.tensors, ckpt.summary()
    for name, tensor in iter_tensors(ckpt, device="cuda", expected=model_schema):
        ...
    state_dict = load_state_dict("path/to/model", expected=model_schema, device="cuda")
    fill_targets(named, model_targets, device="cuda", threads=8)   # reader threads, into the model's memory
    layout, named = match_layout(ckpt, layouts, model_schema, family="deepseek_v4")  # renamed catalogue
"""

from dayzero.weights.checkpoint import Checkpoint, format_bytes
from dayzero.weights.errors import (CorruptCheckpointError, InvalidValuesError, MissingTensorError, NoWeightsError,
                                    TensorDtypeError, TensorShapeError, UnexpectedTensorError,
                                    WeightsError)
from dayzero.weights.header import DTYPES, SafetensorsFile, TensorInfo, read_header
from dayzero.weights.fill import fill_targets
from dayzero.weights.layouts import Chunk, Layout, Rename, Unstack, match_layout
from dayzero.weights.loader import LoadSummary, iter_tensors, load_state_dict, read_tensor
from dayzero.weights.schema import FLOAT_DTYPES, TensorSpec, check_schema, find_problems

__all__ = [
    "Checkpoint", "Chunk", "CorruptCheckpointError", "DTYPES", "FLOAT_DTYPES", "InvalidValuesError", "Layout", "LoadSummary",
    "MissingTensorError", "NoWeightsError", "Rename", "SafetensorsFile", "TensorDtypeError", "TensorInfo",
    "TensorShapeError", "TensorSpec", "UnexpectedTensorError", "Unstack", "WeightsError", "check_schema",
    "fill_targets", "find_problems", "format_bytes", "iter_tensors", "load_state_dict", "match_layout", "read_header",
    "read_tensor",
]
