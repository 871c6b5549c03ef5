"""flce: the fused linear + cross-entropy loss as a service, for Python workers."""

from flce.client import (Client, FlceError, ForwardResult, Gradients, SharedMemoryRegion,
                         from_wire, to_torch, to_wire)

__all__ = ["Client", "FlceError", "ForwardResult", "Gradients", "SharedMemoryRegion",
           "from_wire", "to_torch", "to_wire", "RemoteLinearCrossEntropy"]


def __getattr__(name):
    # torch is imported only by those who use the module.
    if name == "RemoteLinearCrossEntropy":
        from flce.torch_loss import RemoteLinearCrossEntropy

        return RemoteLinearCrossEntropy
    raise AttributeError(name)
