"""Loading Hugging Face safetensors checkpoints: catalogue, schema check, streaming.

    ckpt = Checkpoint.open("path/to/model")        # headers only: ckpt.tensors, ckpt.summary()
    for name, tensor in iter_tensors(ckpt, device="cuda", expected=model_schema):
        ...
    state_dict = load_state_dict("path/to/model", expected=model_schema, device="cuda")
"""

from dayzero.weights.checkpoint import Checkpoint, format_bytes
from dayzero.weights.errors import (CorruptCheckpointError, MissingTensorError, NoWeightsError,
                                    TensorDtypeError, TensorShapeError, UnexpectedTensorError,
                                    WeightsError)
from dayzero.weights.header import DTYPES, SafetensorsFile, TensorInfo, read_header
from dayzero.weights.loader import LoadSummary, iter_tensors, load_state_dict, read_tensor
from dayzero.weights.schema import FLOAT_DTYPES, TensorSpec, check_schema, find_problems

__all__ = [
    "Checkpoint", "CorruptCheckpointError", "DTYPES", "FLOAT_DTYPES", "LoadSummary", "MissingTensorError",
    "NoWeightsError", "SafetensorsFile", "TensorDtypeError", "TensorInfo", "TensorShapeError",
    "TensorSpec", "UnexpectedTensorError", "WeightsError", "check_schema", "find_problems",
    "format_bytes", "iter_tensors", "load_state_dict", "read_header", "read_tensor",
]
