"""The wire's dtypes beside NumPy's and torch's (torch imported only when asked for)."""

import numpy as np

from flce_pb.v1 import loss_service_pb2 as pb

# str(torch dtype) → wire dtype.
TORCH_TO_WIRE = {"torch.float32": pb.DTYPE_FLOAT32, "torch.float16": pb.DTYPE_FLOAT16,
                 "torch.bfloat16": pb.DTYPE_BFLOAT16, "torch.int32": pb.DTYPE_INT32,
                 "torch.int64": pb.DTYPE_INT64}

_WIRE_TO_TORCH_NAME = {pb.DTYPE_FLOAT32: "float32", pb.DTYPE_FLOAT16: "float16",
                       pb.DTYPE_BFLOAT16: "bfloat16", pb.DTYPE_INT32: "int32",
                       pb.DTYPE_INT64: "int64"}


def torch_dtype(wire_dtype):
    """The torch dtype of a wire dtype."""
    import torch

    return getattr(torch, _WIRE_TO_TORCH_NAME[wire_dtype])


def is_cuda(tensor) -> bool:
    return tensor is not None and getattr(tensor, "is_cuda", False)


# wire dtype → NumPy dtype (bf16 has none).
NP_DTYPES = {
    pb.DTYPE_FLOAT32: np.float32,
    pb.DTYPE_FLOAT16: np.float16,
    pb.DTYPE_INT32: np.int32,
    pb.DTYPE_INT64: np.int64,
}


def elem_size(wire_dtype: int) -> int:
    return 2 if wire_dtype in (pb.DTYPE_BFLOAT16, pb.DTYPE_FLOAT16) else (
        8 if wire_dtype == pb.DTYPE_INT64 else 4)


def wire_dtype(dtype) -> int:
    for wire, np_dtype in NP_DTYPES.items():
        if np.dtype(np_dtype) == np.dtype(dtype):
            return wire
    raise TypeError(f"dtype {dtype} is not supported by flce (float32/float16/bfloat16/int32/int64)")
