"""POSIX shared memory between a same-host worker and an flce server."""

import numpy as np

from flce.wire_dtypes import TORCH_TO_WIRE, elem_size as _elem_size, torch_dtype
from flce.wire_dtypes import wire_dtype as _wire_dtype
from flce_pb.v1 import loss_service_pb2 as pb


class SharedMemoryRegion:
    """A POSIX shared-memory region of this process, registered with the
    server (which must run with --enable_shared_memory). Tensors passed with
    ``shm=region`` are copied into it instead of the message; gradients come
    back through it. ``close()`` unregisters and frees it."""

    def __init__(self, client: "Client", nbytes: int):
        from multiprocessing import shared_memory

        self._shm = shared_memory.SharedMemory(create=True, size=nbytes)
        self.nbytes = nbytes
        self._client = client
        self._file = None  # np.memmap of the object, for view_torch
        self._views = []   # weak references to view_torch's arrays
        try:
            self.region_id = client._call(
                client._stub.RegisterSharedMemory,
                pb.RegisterSharedMemoryRequest(shm_name="/" + self._shm.name.lstrip("/"),
                                               bytes=nbytes)).region_id
        except Exception:
            self._shm.close()
            self._shm.unlink()
            raise

    @property
    def buffer(self) -> memoryview:
        return self._shm.buf

    def write(self, tensor, out: "pb.Tensor", offset: int) -> int:
        """Copies a NumPy array or torch tensor into the region at ``offset``
        (one copy) and sets ``out`` to its dtype, shape and slice; returns
        the next 64-byte aligned offset."""
        if hasattr(tensor, "detach"):  # torch
            import torch

            t = tensor.detach()
            if t.device.type != "cpu":
                t = t.to("cpu")
            t = t.contiguous()
            out.dtype = TORCH_TO_WIRE[str(t.dtype)]
            raw = t.reshape(-1).view(torch.uint8)
            nbytes = raw.numel()
            self._check_fits(offset, nbytes)
            if nbytes:
                torch.frombuffer(self.buffer, dtype=torch.uint8, count=nbytes,
                                 offset=offset).copy_(raw)
            shape = list(t.shape)
        else:
            arr = np.ascontiguousarray(tensor)
            out.dtype = _wire_dtype(arr.dtype)
            arr = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
            nbytes = arr.nbytes
            self._check_fits(offset, nbytes)
            if nbytes:
                np.copyto(np.frombuffer(self.buffer, np.uint8, nbytes, offset),
                          arr.reshape(-1).view(np.uint8))
            shape = list(arr.shape)
        del out.shape[:]
        out.shape.extend(shape)
        out.shm.region_id = self.region_id
        out.shm.offset = offset  # (setting the oneof drops any bytes)
        return (offset + nbytes + 63) // 64 * 64

    def view_torch(self, tensor: "pb.Tensor"):
        """A torch tensor that *is* the slice of this region a wire tensor
        names (no copy): it stays valid after the region is closed, and
        while any such view lives the region is :meth:`in_use` (its bytes
        must not be written by another call)."""
        import weakref

        import torch

        if self._file is None:  # a mapping of our own: the views outlive close()
            self._file = np.memmap(f"/dev/shm/{self._shm.name}", dtype=np.uint8, mode="r+",
                                   shape=(self.nbytes,))
        shape = tuple(tensor.shape)
        nbytes = (int(np.prod(shape)) if shape else 1) * _elem_size(tensor.dtype)
        part = self._file[tensor.shm.offset:tensor.shm.offset + nbytes]
        self._views = [ref for ref in self._views if ref() is not None] + [weakref.ref(part)]
        return torch.from_numpy(part).view(torch_dtype(tensor.dtype)).reshape(shape)

    def in_use(self) -> bool:
        """Whether a tensor :meth:`view_torch` returned is still alive."""
        return any(ref() is not None for ref in self._views)

    def _check_fits(self, offset, nbytes):
        if offset + nbytes > self.nbytes:
            raise ValueError(f"shm: the tensors need more than the region's {self.nbytes} bytes")

    def close(self):
        if self._shm is None:
            return
        try:
            self._client._call(self._client._stub.UnregisterSharedMemory,
                               pb.UnregisterSharedMemoryRequest(region_id=self.region_id))
        finally:
            self._shm.close()
            self._shm.unlink()
            self._shm = None
