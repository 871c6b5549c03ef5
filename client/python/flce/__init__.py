"""flce: the fused linear + cross-entropy loss as a service, for Python workers."""

# The server's version (common/version.h); tools/build_wheel.sh refuses to
# build a wheel where they differ.
__version__ = "0.1.0"

from flce.client import (DEFAULT_PORT, Client, FlceError, ForwardResult, Gradients,
                         SharedMemoryRegion, check_loss_options, from_wire, to_torch, to_wire,
                         with_default_port)

__all__ = ["__version__", "Client", "DEFAULT_PORT", "FlceError", "ForwardResult", "Gradients",
           "SharedMemoryRegion", "check_loss_options", "from_wire", "to_torch", "to_wire",
           "with_default_port", "RemoteLinearCrossEntropy"]


def __getattr__(name):
    # torch is imported only by those who use the module.
    if name == "RemoteLinearCrossEntropy":
        from flce.torch_loss import RemoteLinearCrossEntropy

        return RemoteLinearCrossEntropy
    raise AttributeError(name)
