"""Forward, Backward and ReleaseSession through a call channel (same host).

A same-host call through gRPC wakes several threads on both sides, and on
an idle (virtual) CPU each wake-up costs about 0.2 ms; the whole Python gRPC
round trip costs 0.4-1.2 ms (bench/RESULTS.md). A call channel is a POSIX
shared-memory region the server polls: the request goes in, the server's
thread serves it (the same messages, semantics, errors and bounds as the
RPCs) and writes the answer back, which this process polls for. The
protocol is the server's proto/call_channel_layout.h.

:class:`flce.Client` opens one by itself for calls that pass tensors
through shared memory or CUDA IPC (they are same-host already), and uses
gRPC where no channel can be had (a server without shared memory, its
channel bound reached, a request larger than the channel's area, a platform
other than x86-64 Linux).
"""

import ctypes
import os
import platform
import struct
import threading
import time
from typing import Optional

import grpc

from flce_pb.v1 import loss_service_pb2 as pb

MAGIC = 0x3130484345434C46  # "FLCECH01"
HEADER_BYTES = 4096
_REQUEST_SEQ, _RESPONSE_SEQ, _CLIENT_WAITING = 64, 128, 192
_CANCEL_SEQ, _CLOSED = 320, 384
_REQUEST_METHOD, _REQUEST_LENGTH, _REQUEST_TIMEOUT_US = 448, 452, 456
_RESPONSE_CODE, _RESPONSE_LENGTH = 512, 516
FORWARD, BACKWARD, RELEASE_SESSION = 1, 2, 3

_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def supported() -> bool:
    """Whether this platform can use call channels: x86-64 Linux, whose
    store ordering the protocol relies on (writes from Python are plain
    stores)."""
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")


class ChannelClosed(Exception):
    """The server closed the channel before it took the call: the call was
    not made (make it again elsewhere)."""


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = None


def _futex():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    return _libc.syscall


class CallChannel:
    """One channel of a :class:`flce.Client`: ``call`` makes one call at a
    time through it. A call sleeps in futex(2) until shortly before its
    answer is due (as long as the last call of the same method took), then
    polls for up to ``spin_s``, then sleeps until the server wakes it:
    polling costs this thread's CPU, a sleep that the answer has to end
    costs a wake-up (about 0.2 ms on an idle virtual CPU)."""

    def __init__(self, client, request_bytes: int = 1 << 20, response_bytes: int = 1 << 20,
                 spin_s: float = 0.25):
        from multiprocessing import shared_memory

        if not supported():
            raise RuntimeError("call channels need x86-64 Linux")
        size = HEADER_BYTES + request_bytes + response_bytes
        self._shm = shared_memory.SharedMemory(create=True, size=size)
        self._client = client
        self.request_bytes, self.response_bytes = request_bytes, response_bytes
        self.spin_s = spin_s
        self.region_id = ""
        self.channel_id = ""
        self.broken = False  # unusable: a call was abandoned, or the server closed it
        self._lock = threading.Lock()
        buf = self._shm.buf
        struct.pack_into("<Q", buf, 0, MAGIC)
        self._words = {off: ctypes.c_uint32.from_buffer(buf, off)
                       for off in (_REQUEST_SEQ, _RESPONSE_SEQ, _CLIENT_WAITING, _CANCEL_SEQ,
                                   _CLOSED, _REQUEST_METHOD, _REQUEST_LENGTH, _RESPONSE_CODE,
                                   _RESPONSE_LENGTH)}
        self._timeout_us = ctypes.c_uint64.from_buffer(buf, _REQUEST_TIMEOUT_US)
        self._addr = {off: ctypes.addressof(self._words[off]) for off in (_REQUEST_SEQ,
                                                                           _RESPONSE_SEQ)}
        self._seq = 0
        self._took = {}  # method → seconds its last call took
        try:
            self.region_id = client._call(
                client._stub.RegisterSharedMemory,
                pb.RegisterSharedMemoryRequest(shm_name="/" + self._shm.name.lstrip("/"),
                                               bytes=size)).region_id
            opened = client._call(client._stub.OpenCallChannel, pb.OpenCallChannelRequest(
                region_id=self.region_id, request_bytes=request_bytes,
                response_bytes=response_bytes))
            self.channel_id = opened.channel_id
            self.server_spin_us = opened.spin_us
        except Exception:
            self.close()
            raise

    def call(self, method: int, request, response_type, timeout: float):
        """Makes one call: the response message, or FlceError with the
        server's code and message. ChannelClosed when the server closed
        the channel before taking it; ValueError when the request does not
        fit the request area (neither was sent)."""
        from flce.client import FlceError

        payload = request.SerializeToString()
        if len(payload) > self.request_bytes:
            raise ValueError(f"call channel: a {len(payload)}-byte request, over the channel's "
                             f"{self.request_bytes}")
        if not self._lock.acquire(blocking=False):
            raise BlockingIOError("call channel: busy with another thread's call")
        try:
            if self.broken or self._words[_CLOSED].value:
                self.broken = True
                raise ChannelClosed()
            words = self._words
            buf = self._shm.buf
            buf[HEADER_BYTES:HEADER_BYTES + len(payload)] = payload
            words[_REQUEST_METHOD].value = method
            words[_REQUEST_LENGTH].value = len(payload)
            self._timeout_us.value = max(1, int(timeout * 1e6)) if timeout else 0
            seq = self._seq % 0xFFFFFFFF + 1
            self._seq = seq
            start = time.monotonic()
            words[_REQUEST_SEQ].value = seq  # the call is made here
            _futex()(_SYS_FUTEX, ctypes.c_void_p(self._addr[_REQUEST_SEQ]), _FUTEX_WAKE, 1,
                     None, None, 0)
            self._wait(seq, start, timeout, self._took.get(method, 0.0))
            self._took[method] = time.monotonic() - start
            code = words[_RESPONSE_CODE].value
            length = min(words[_RESPONSE_LENGTH].value, self.response_bytes)
            start = HEADER_BYTES + self.request_bytes
            body = bytes(buf[start:start + length])
        finally:
            self._lock.release()
        if code != 0:
            raise FlceError(_CODES.get(code, grpc.StatusCode.UNKNOWN),
                            body.decode("utf-8", "replace"))
        return response_type.FromString(body)

    def _wait(self, seq: int, start: float, timeout: float, expected: float):
        from flce.client import FlceError

        words = self._words
        response, closed = words[_RESPONSE_SEQ], words[_CLOSED]
        # Asleep until shortly before the answer is due, then polling.
        poll_from = start + expected - (0.0003 + expected / 16)
        spin_until = max(poll_from, start) + self.spin_s
        deadline = start + timeout if timeout else float("inf")
        cancelled_at = None
        while response.value != seq:
            if closed.value:
                if response.value == seq:
                    break
                self.broken = True
                raise ChannelClosed()
            now = time.monotonic()
            if now > deadline and cancelled_at is None:
                # The server answers CANCELLED (or the result it had) soon.
                words[_CANCEL_SEQ].value = seq
                cancelled_at = now
            if cancelled_at is not None and now > cancelled_at + 10.0:
                self.broken = True  # an answer may still land here later
                raise FlceError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                "call channel: no answer after the deadline and a cancel")
            if poll_from <= now < spin_until:
                os.sched_yield()  # lets other threads (and their GIL) run
                continue
            seen = response.value
            if seen == seq:
                break
            words[_CLIENT_WAITING].value = 1
            nap = min(poll_from - now, 0.05) if now < poll_from else 0.05
            wait = _Timespec(0, int(nap * 1e9))
            _futex()(_SYS_FUTEX, ctypes.c_void_p(self._addr[_RESPONSE_SEQ]), _FUTEX_WAIT, seen,
                     ctypes.byref(wait), None, 0)
            words[_CLIENT_WAITING].value = 0

    def close(self):
        """Closes the channel and frees its region (idempotent)."""
        client, self._client = self._client, None
        if client is not None:
            for stub, request in ((client._stub.CloseCallChannel,
                                   pb.CloseCallChannelRequest(channel_id=self.channel_id)),
                                  (client._stub.UnregisterSharedMemory,
                                   pb.UnregisterSharedMemoryRequest(region_id=self.region_id))):
                if not request.ListFields():
                    continue
                try:
                    client._call(stub, request)
                except Exception:  # pragma: no cover - the server went away
                    pass
        if self._shm is not None:
            self._words = {}
            self._timeout_us = None
            shm, self._shm = self._shm, None
            try:
                shm.close()
            except BufferError:  # pragma: no cover - a view still alive
                pass
            shm.unlink()
