"""CUDA IPC between a same-host PyTorch worker and an flce server.

The server (CUDA backend, --enable_shared_memory) reads hidden states and
weights from, and writes gradients into, this process's GPU memory: nothing
but the targets and a few numbers travel through gRPC, and nothing is copied
on either GPU side.

Registrations last: each GPU allocation that holds a tensor (a segment of
PyTorch's caching allocator, or any cudaMalloc) is registered once, the
first time a call names it, and reused by every later call. An allocation
is known by its base address *and* the driver's process-wide buffer id, so
memory freed and allocated again at the same address is a new allocation:
its old registration is dropped and the new one registered, never read
through a stale mapping. Every call first sweeps the registrations for
allocations that are gone (freed by ``torch.cuda.empty_cache()``, say) and
unregisters them.

Ordering is stream-ordered, not device-wide: before a call, the client
records an interprocess CUDA event on the current stream (after the work
that produced its tensors, and the last use of its gradient outputs) and
names it in the request; the server's stream waits for it on the GPU. The
server answers only once its writes are done, so work the worker queues
after the answer sees them.
"""

import ctypes
import threading
from collections import OrderedDict
from typing import Dict, List

from flce.wire_dtypes import TORCH_TO_WIRE
from flce_pb.v1 import loss_service_pb2 as pb

# cuPointerGetAttribute(s) attributes (cuda.h).
_CU_POINTER_ATTRIBUTE_BUFFER_ID = 7
_CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11
_CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12



class _Driver:
    """The few CUDA driver calls the registry needs, through ctypes."""

    def __init__(self):
        self._cuda = ctypes.CDLL("libcuda.so.1")
        self._cuda.cuPointerGetAttributes.argtypes = [
            ctypes.c_uint, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_uint64]
        self._cuda.cuIpcGetMemHandle.argtypes = [ctypes.c_char_p, ctypes.c_uint64]
        self._cuda.cuStreamWaitValue32_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64,
                                                      ctypes.c_uint32, ctypes.c_uint]
        self._cuda.cuMemHostGetDevicePointer_v2.argtypes = [
            ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
        attrs = (_CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, _CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                 _CU_POINTER_ATTRIBUTE_BUFFER_ID)
        self._attrs = (ctypes.c_int * 3)(*attrs)
        # The answers' storage, made once (callers hold the registry's lock).
        self._base, self._size, self._buffer_id = (ctypes.c_uint64(), ctypes.c_size_t(),
                                                   ctypes.c_uint64())
        self._data = (ctypes.c_void_p * 3)(
            ctypes.cast(ctypes.byref(self._base), ctypes.c_void_p),
            ctypes.cast(ctypes.byref(self._size), ctypes.c_void_p),
            ctypes.cast(ctypes.byref(self._buffer_id), ctypes.c_void_p))

    def allocation(self, ptr: int):
        """(base, size, buffer id) of the allocation holding ``ptr``, or None
        when no allocation of this process's holds it."""
        if self._cuda.cuPointerGetAttributes(3, self._attrs, self._data, ptr) != 0:
            return None
        if self._base.value == 0 and self._size.value == 0:
            return None
        return self._base.value, self._size.value, self._buffer_id.value

    def wait_value(self, stream: int, device_address: int, value: int):
        """Queues on `stream` a wait until the 32-bit word at
        `device_address` is at least `value` (cyclically)."""
        result = self._cuda.cuStreamWaitValue32_v2(ctypes.c_void_p(stream), device_address,
                                                   value, 0)  # CU_STREAM_WAIT_VALUE_GEQ
        if result != 0:
            raise RuntimeError(f"cuda_ipc: cuStreamWaitValue32 failed with CUDA driver error "
                               f"{result}")

    def device_address(self, host: int) -> int:
        """The device address of registered host memory."""
        address = ctypes.c_uint64()
        result = self._cuda.cuMemHostGetDevicePointer_v2(ctypes.byref(address),
                                                         ctypes.c_void_p(host), 0)
        if result != 0:
            raise RuntimeError(f"cuda_ipc: cuMemHostGetDevicePointer failed with CUDA driver "
                               f"error {result}")
        return address.value

    def ipc_handle(self, base: int) -> bytes:
        handle = ctypes.create_string_buffer(64)
        result = self._cuda.cuIpcGetMemHandle(handle, base)
        if result != 0:
            raise RuntimeError(
                f"cuda_ipc: cuIpcGetMemHandle failed with CUDA driver error {result}: the "
                "allocation cannot be exported through CUDA IPC (PyTorch's "
                "expandable_segments allocator and cudaMallocAsync pools cannot be; use the "
                "default caching allocator)")
        return handle.raw


class _Entry:
    __slots__ = ("buffer_id", "region_id", "size")

    def __init__(self, buffer_id, region_id, size):
        self.buffer_id = buffer_id
        self.region_id = region_id
        self.size = size


class CudaIpcRegistry:
    """This process's GPU allocations and events registered with one server,
    kept across calls (see the module's doc). One per :class:`flce.Client`
    (``client.cuda_ipc()``); thread-safe. ``max_entries`` bounds the
    allocations kept registered: past it the least recently used is
    unregistered. ``keep=False`` registers each call's allocations for that
    call only (two more small RPCs per tensor and call), for workers that
    free cached GPU memory while training: CUDA calls freeing memory that
    another process still maps undefined, and until the next call's sweep a
    registration made by an earlier call may still map a segment the
    caching allocator has given back."""

    def __init__(self, client, max_entries: int = 256, keep: bool = True):
        self._client = client
        # False: every call's allocations are unregistered when it ends (see
        # release_allocations).
        self.keep = keep
        self._driver = _Driver()
        self._lock = threading.Lock()
        self._entries: "OrderedDict[int, _Entry]" = OrderedDict()  # base → entry, LRU order
        self._events: Dict[int, List] = {}  # device index → free (event, region id) pairs
        self._event_regions: List[str] = []
        self._fences: Dict[tuple, int] = {}  # (channel, device) → the fence's device address
        self.max_entries = max_entries
        self.registrations = 0  # allocations registered so far (for tests and benchmarks)

    # -- allocations ---------------------------------------------------------

    def slice(self, tensor, accumulate: bool = False) -> "pb.SharedMemorySlice":
        """The slice naming ``tensor``'s bytes (contiguous, on the GPU),
        registering its allocation if this is the first call to name it."""
        if not tensor.is_cuda or not tensor.is_contiguous():
            raise ValueError("cuda_ipc: tensors must be contiguous CUDA tensors")
        ptr = tensor.data_ptr()
        with self._lock:
            found = self._driver.allocation(ptr)
            if found is None:
                raise ValueError("cuda_ipc: the tensor's memory is not a CUDA allocation of "
                                 "this process")
            base, size, buffer_id = found
            entry = self._entries.get(base)
            if entry is not None and entry.buffer_id != buffer_id:
                # Freed and allocated again at the same address: a new allocation.
                self._drop(base)
                entry = None
            if entry is None:
                entry = self._register(base, size, buffer_id)
            self._entries.move_to_end(base)
            return pb.SharedMemorySlice(region_id=entry.region_id, offset=ptr - base,
                                        accumulate=accumulate)

    def place(self, tensor, out: "pb.Tensor"):
        """Sets ``out`` to ``tensor``'s dtype, shape and slice (no bytes)."""
        out.dtype = TORCH_TO_WIRE[str(tensor.dtype)]
        del out.shape[:]
        out.shape.extend(tensor.shape)
        out.shm.CopyFrom(self.slice(tensor))

    def sweep(self):
        """Unregisters the allocations that are gone (freed, or their address
        now holds another allocation)."""
        with self._lock:
            for base in list(self._entries):
                found = self._driver.allocation(base)
                if found is None or found[0] != base or found[2] != self._entries[base].buffer_id:
                    self._drop(base)

    def release_allocations(self):
        """Unregisters every allocation (the events stay). Call it before
        freeing cached GPU memory (``torch.cuda.empty_cache()``) if the
        server must never map memory the allocator has given back; with
        ``keep=False`` the client calls it after every call."""
        with self._lock:
            for base in list(self._entries):
                self._drop(base)

    def registered(self) -> int:
        """Allocations registered now."""
        with self._lock:
            return len(self._entries)

    def _register(self, base, size, buffer_id) -> _Entry:
        if len(self._entries) >= self.max_entries:
            self._drop(next(iter(self._entries)))
        handle = self._driver.ipc_handle(base)
        response = self._client._call(
            self._client._stub.RegisterSharedMemory,
            pb.RegisterSharedMemoryRequest(cuda_ipc_handle=handle, bytes=0))
        entry = _Entry(buffer_id, response.region_id, size)
        self._entries[base] = entry
        self.registrations += 1
        return entry

    def _drop(self, base):
        entry = self._entries.pop(base)
        self._unregister(entry.region_id)

    def _unregister(self, region_id):
        try:
            self._client._call(self._client._stub.UnregisterSharedMemory,
                               pb.UnregisterSharedMemoryRequest(region_id=region_id))
        except Exception:  # pragma: no cover - the server went away; its mapping goes with it
            pass

    # -- events --------------------------------------------------------------

    def record_ready(self, device) -> "tuple":
        """Records an interprocess event on ``device``'s current stream;
        returns (token, region id): name the region id as the request's
        ready_event and give the token back with :meth:`done` once the call
        has returned."""
        import torch

        index = torch.device(device).index
        if index is None:
            index = torch.cuda.current_device()
        with self._lock:
            free = self._events.setdefault(index, [])
            pair = free.pop() if free else None
        stream = torch.cuda.current_stream(index)
        if pair is None:
            with torch.cuda.device(index):
                event = torch.cuda.Event(interprocess=True)
                event.record(stream)
                response = self._client._call(
                    self._client._stub.RegisterSharedMemory,
                    pb.RegisterSharedMemoryRequest(cuda_ipc_event_handle=event.ipc_handle(),
                                                   bytes=0))
            pair = (event, response.region_id)
            with self._lock:
                self._event_regions.append(response.region_id)
        else:
            pair[0].record(stream)
        return (index, pair), pair[1]

    def done(self, token):
        """The call that named this token's event has returned."""
        index, pair = token
        with self._lock:
            self._events.setdefault(index, []).append(pair)

    # -- fences ----------------------------------------------------------------

    def wait_fence(self, channel, seq: int, device):
        """Queues on ``device``'s current stream a wait for the answer to
        call ``seq`` of ``channel`` (its fence word): work queued after it
        runs once the server is done with this process's memory."""
        import torch

        index = torch.device(device).index
        if index is None:
            index = torch.cuda.current_device()
        address = self._fences.get((id(channel), index))
        if address is None:
            address = self._register_fence(channel, index)
        self._driver.wait_value(torch.cuda.current_stream(index).cuda_stream, address, seq)

    def _register_fence(self, channel, index) -> int:
        """Makes the channel's header page visible to the GPU (pinned), once
        per channel and device; unregistered when the channel closes."""
        import torch

        page = channel.fence() & ~4095
        with torch.cuda.device(index):
            error = torch.cuda.cudart().cudaHostRegister(page, 4096, 3)  # portable | mapped
            if int(error) != 0:
                raise RuntimeError(f"cuda_ipc: cudaHostRegister of the call channel: {error}")
            address = self._driver.device_address(page) + (channel.fence() - page)

        def unregister():
            with torch.cuda.device(index):
                torch.cuda.cudart().cudaHostUnregister(page)
            self._fences.pop((id(channel), index), None)

        channel.on_close.append(unregister)
        self._fences[(id(channel), index)] = address
        return address

    # -- the end ---------------------------------------------------------------

    def close(self):
        """Unregisters everything (the server would unmap it all when the
        connection's principal goes, but not before)."""
        with self._lock:
            regions = [e.region_id for e in self._entries.values()] + self._event_regions
            self._entries.clear()
            self._events.clear()
            self._event_regions = []
        for region_id in regions:
            self._unregister(region_id)
