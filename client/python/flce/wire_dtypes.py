"""The wire's dtypes beside torch's (torch imported only when asked for)."""

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
