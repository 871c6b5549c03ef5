"""The upstream gradient checked on the GPU, so that backward need not wait.

Through CUDA IPC the drop-in's Forward brings the gradients for the upstream
gradient the last backward had (see :mod:`flce.torch_loss`), and returns as
soon as the server accepted it. Backward must hand autograd the gradients of
the upstream gradient it *got*, which lives on the GPU behind the server's
work: reading it on the host waits for the whole call, and the worker's
Python (autograd's end, the caller's next kernels) then runs after the
server instead of beside it.

A gate checks it on the GPU instead. :meth:`UpstreamGate.shut` queues on the
current stream, behind the call's fence: the check that the call wrote the
loss (the worker fills it with NaN before the call; the server writes it
last, only when the whole computation succeeded) and that the upstream
gradient is the one the gradients were made for, and the result's copy into
a word of page-locked memory: the gate's number if both hold, 0 if not. The
stream then waits until that word holds the gate's number
(cuStreamWaitValue32). Backward returns the gradients at once; work queued
after it runs once the gate opens.

When the check holds the GPU opens the gate by itself (a loss that is NaN
from the computation itself only costs the thread's confirmation). When it does not, the gate's
thread (which sees every gate's check once it has run) calls the caller's
``resolve`` — have the server redo the gradients for this upstream gradient,
or keep the call's error — and then opens it from the host. ``resolve`` must
queue no work on this process's GPU: the waiting stream can hold up other
streams that share its hardware queue. The
caller settles its gates (:meth:`UpstreamGate.settle`) before its next call
that queues work on the server: a gate still shut waits for its thread.
"""

import ctypes
import mmap
import threading
from collections import deque
from typing import Callable, Optional

from flce.cuda_ipc import _Driver

_ON_GATE_THREAD = threading.local()
_SLOTS = 256  # gates open at once, at most (one word and one float each)
_CU_STREAM_WAIT_VALUE_EQ = 0x1


class GateJob:
    """One gate: the check of one call's upstream gradient."""

    __slots__ = ("seq", "slot", "event", "pending", "expected", "resolve", "keep", "value",
                 "error", "redone", "resolved", "_done")

    def __init__(self, seq, slot, event, pending, expected, resolve, keep):
        self.seq, self.slot, self.event = seq, slot, event
        self.pending, self.expected, self.resolve = pending, expected, resolve
        self.keep = keep  # tensors the server reads or writes, alive until settled
        self.value = None  # the upstream gradient, once its copy has arrived
        self.error = None  # the call's error (the gradients hold NaN)
        self.redone = False  # resolve redid the gradients (the session is consumed)
        self.resolved = False  # the host opened the gate
        self._done = threading.Event()


class UpstreamGate:
    """A :class:`flce.Client`'s gates on one device (see the module's doc)."""

    def __init__(self, device_index: int):
        import torch

        self._driver = _Driver()
        self._index = device_index
        # One page of page-locked memory the GPU writes and waits on: the
        # gate words (int64, waited on in their low 32 bits), then the
        # upstream gradients' copies.
        self._page = mmap.mmap(-1, 4096)
        self._address = ctypes.addressof(ctypes.c_char.from_buffer(self._page))
        with torch.cuda.device(device_index):
            error = torch.cuda.cudart().cudaHostRegister(self._address, 4096, 3)
            if int(error) != 0:
                raise RuntimeError(f"upstream gate: cudaHostRegister: {error}")
            self._device_address = self._driver.device_address(self._address)
        self._words = torch.frombuffer(self._page, dtype=torch.int64, count=_SLOTS)
        self._values = torch.frombuffer(self._page, dtype=torch.float32, count=_SLOTS,
                                        offset=8 * _SLOTS)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._jobs = deque()  # not yet settled, in order
        self._unseen = deque()  # not yet seen by the thread
        self._seq = 0
        self._events = []  # events of settled gates, recorded again by later ones
        self._thread = None
        self._closing = False

    def _word(self, slot: int) -> int:
        return ctypes.c_int64.from_address(self._address + 8 * slot).value

    def shut(self, loss, pending, grad_output, expected: float,
             resolve: Callable[["GateJob"], None], keep) -> GateJob:
        """Queues the gate on the current stream (see the module's doc) for
        a Forward in flight (its ``pending``), whose fence the stream waits
        on already, whose ``loss`` (0-dim fp32, NaN before the call) it
        writes last and whose gradients were made for ``expected``;
        ``grad_output`` is the 0-dim upstream gradient autograd gave.
        ``resolve(job)`` runs on the gate's thread when the check fails,
        before the gate opens."""
        import torch

        with self._lock:
            if len(self._jobs) >= _SLOTS - 1:
                raise RuntimeError("upstream gate: too many gates shut at once")
            self._seq = self._seq % 0x7FFFFFFF + 1
            seq = self._seq
        slot = seq % _SLOTS
        stream = torch.cuda.current_stream(self._index)
        g = grad_output.detach().reshape(1).float()
        shut = torch.where((g != expected) | loss.detach().reshape(1).isnan(), 0, seq)
        self._words[slot:slot + 1].copy_(shut, non_blocking=True)
        self._values[slot:slot + 1].copy_(g, non_blocking=True)
        with self._lock:
            event = self._events.pop() if self._events else None
        if event is None:
            event = torch.cuda.Event(blocking=True)
        event.record(stream)
        self._driver.wait_value(stream.cuda_stream, self._device_address + 8 * slot, seq,
                                _CU_STREAM_WAIT_VALUE_EQ)
        job = GateJob(seq, slot, event, pending, expected, resolve, keep)
        with self._lock:
            self._jobs.append(job)
            self._unseen.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="flce-upstream-gate")
                self._thread.start()
            self._cond.notify()
        return job

    def settle(self, upto: Optional[GateJob] = None):
        """Waits until the gates shut so far (up to ``upto``) are open: once
        the GPU opened one, at once; a shut one waits for its thread. Runs
        nothing on a gate's thread (a resolve that calls the client)."""
        if getattr(_ON_GATE_THREAD, "value", False):
            return  # (a gate's resolve calling the client)
        while True:
            with self._lock:
                if not self._jobs:
                    return
                job = self._jobs[0]
            job.event.synchronize()
            if self._word(job.slot) != job.seq:
                job._done.wait()
            with self._lock:
                if self._jobs and self._jobs[0] is job:
                    self._jobs.popleft()
                    if job._done.is_set():  # (else the thread still reads it)
                        self._events.append(job.event)
            job.keep = None
            if job is upto:
                return

    def _run(self):
        _ON_GATE_THREAD.value = True
        while True:
            with self._lock:
                while not self._unseen and not self._closing:
                    if not self._cond.wait(timeout=1.0) and not self._unseen:
                        self._thread = None  # idle: a later gate starts another
                        return
                if self._closing and not self._unseen:
                    return
                job = self._unseen.popleft()
            job.event.synchronize()
            if self._word(job.slot) != job.seq:
                job.value = float(self._values[job.slot].item())
                try:
                    job.resolve(job)
                except BaseException as e:  # pragma: no cover - resolve keeps its errors
                    job.error = job.error or e
                finally:
                    job.resolved = True
                    ctypes.c_int64.from_address(self._address + 8 * job.slot).value = job.seq
            # (Nothing more when the GPU opened it: Python here competes for
            # the interpreter with the caller's, which then runs.)
            job.keep = None
            job._done.set()

    def close(self):
        """Settles every gate, then unregisters the page (idempotent)."""
        import torch

        if self._page is None:
            return
        self.settle()
        with self._lock:
            self._closing = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._words = self._values = None
        with torch.cuda.device(self._index):
            torch.cuda.cudart().cudaHostUnregister(self._address)
        page, self._page = self._page, None
        page.close()
