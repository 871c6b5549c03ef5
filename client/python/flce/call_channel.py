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

import grpc

from flce_pb.v1 import loss_service_pb2 as pb

MAGIC = 0x3130484345434C46  # "FLCECH01"
HEADER_BYTES = 4096
_REQUEST_SEQ, _RESPONSE_SEQ, _CLIENT_WAITING, _SERVER_WAITING = 64, 128, 192, 256
_CANCEL_SEQ, _CLOSED = 320, 384
_REQUEST_METHOD, _REQUEST_LENGTH, _REQUEST_TIMEOUT_US = 448, 452, 456
_RESPONSE_CODE, _RESPONSE_LENGTH = 512, 516
_ACCEPTED_SEQ, _FENCE_SEQ, _HEARTBEAT = 576, 640, 704
# The server beats every 100 ms: this long without a beat, it is gone.
HEARTBEAT_LOST_S = 2.0
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


class Call:
    """A call made through a channel, its answer still to be read."""

    __slots__ = ("seq", "method", "response_type", "start", "timeout")

    def __init__(self, seq, method, response_type, start, timeout):
        self.seq, self.method, self.response_type = seq, method, response_type
        self.start, self.timeout = start, timeout


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
        from flce.shared_memory import SharedMemoryRegion

        if not supported():
            raise RuntimeError("call channels need x86-64 Linux")
        # A registered POSIX region of this process's, like any other.
        self._region = SharedMemoryRegion(client, HEADER_BYTES + request_bytes + response_bytes)
        self.region_id = self._region.region_id
        self._client = client
        self.request_bytes, self.response_bytes = request_bytes, response_bytes
        self.spin_s = spin_s
        self.channel_id = ""
        self.broken = False  # unusable: a call was abandoned, or the server closed it
        self.on_close = []  # run first by close()
        self._watched = None  # the call the watch thread watches (the last one watched)
        self._watcher = None
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._barrier = threading.Lock()  # see submit
        buf = self._region.buffer
        struct.pack_into("<Q", buf, 0, MAGIC)
        self._words = {off: ctypes.c_uint32.from_buffer(buf, off)
                       for off in (_REQUEST_SEQ, _RESPONSE_SEQ, _CLIENT_WAITING,
                                   _SERVER_WAITING, _CANCEL_SEQ,
                                   _CLOSED, _REQUEST_METHOD, _REQUEST_LENGTH, _RESPONSE_CODE,
                                   _RESPONSE_LENGTH, _ACCEPTED_SEQ, _FENCE_SEQ, _HEARTBEAT)}
        self._timeout_us = ctypes.c_uint64.from_buffer(buf, _REQUEST_TIMEOUT_US)
        self._addr = {_REQUEST_SEQ: ctypes.addressof(self._words[_REQUEST_SEQ])}
        self._seq = 0
        self._took = {}  # method → seconds its last call took
        try:
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
        fit the request area; BlockingIOError while another thread's call
        holds the channel (none of these was sent)."""
        return self.finish(self.submit(method, request, response_type, timeout))

    def submit(self, method: int, request, response_type, timeout: float) -> "Call":
        """Makes a call and returns at once; the channel is this call's until
        :meth:`finish` reads its answer. Errors as :meth:`call`'s."""
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
            self._region.buffer[HEADER_BYTES:HEADER_BYTES + len(payload)] = payload
            words[_REQUEST_METHOD].value = method
            words[_REQUEST_LENGTH].value = len(payload)
            self._timeout_us.value = max(1, int(timeout * 1e6)) if timeout else 0
            seq = self._seq % 0xFFFFFFFF + 1
            self._seq = seq
            call = Call(seq, method, response_type, time.monotonic(), timeout)
            words[_REQUEST_SEQ].value = seq  # the call is made here
            # A server polling for it needs no wake-up (a system call, and
            # on a VM several µs even with nobody to wake). The server sets
            # its waiting word before it looks at the number a last time and
            # sleeps; between the store above and the load below a full
            # barrier (the uncontended lock's atomic instructions), so that
            # either this load sees the server waiting or the server sees
            # the call.
            self._barrier.acquire()
            self._barrier.release()
            if words[_SERVER_WAITING].value:
                _futex()(_SYS_FUTEX, ctypes.c_void_p(self._addr[_REQUEST_SEQ]), _FUTEX_WAKE, 1,
                         None, None, 0)
            return call
        except BaseException:
            self._lock.release()
            raise

    def accepted(self, call: "Call") -> bool:
        """Waits until the server accepted `call` (True: what is left is the
        engine's work, whose answer :meth:`finish` reads) or answered it
        before that (False: a refusal, or a call that is never accepted)."""
        try:
            return self._wait(call, _ACCEPTED_SEQ, expected=0.0)
        except BaseException:
            self._abandon(call)
            raise

    def finish(self, call: "Call"):
        """Waits for `call`'s answer and returns its response, or raises
        FlceError with the server's code and message (ChannelClosed: the
        call was not made); the channel is free again."""
        from flce.client import FlceError

        try:
            self._wait(call, _RESPONSE_SEQ, self._took.get(call.method, 0.0))
            self._took[call.method] = time.monotonic() - call.start
            words = self._words
            code = words[_RESPONSE_CODE].value
            length = min(words[_RESPONSE_LENGTH].value, self.response_bytes)
            start = HEADER_BYTES + self.request_bytes
            body = bytes(self._region.buffer[start:start + length])
        except BaseException:
            self._abandon(call)
            raise
        self._lock.release()
        if code != 0:
            raise FlceError(_CODES.get(code, grpc.StatusCode.UNKNOWN),
                            body.decode("utf-8", "replace"))
        return call.response_type.FromString(body)

    def _abandon(self, call: "Call"):
        """Gives a call up (no answer will be read): its fence is released
        for a GPU that may wait on it, and the channel is not used again."""
        self.broken = True
        if self._words:
            self._words[_FENCE_SEQ].value = call.seq
        self._lock.release()

    def _wait(self, call: "Call", word: int, expected: float) -> bool:
        """Waits until `word` holds the call's number (True) or the answer
        came (False); raises ChannelClosed or DEADLINE_EXCEEDED."""
        from flce.client import FlceError

        words = self._words
        seq = call.seq
        target, response, closed = words[word], words[_RESPONSE_SEQ], words[_CLOSED]
        # Asleep until shortly before the answer is due, then polling.
        poll_from = call.start + expected - (0.0003 + expected / 16)
        spin_until = max(poll_from, time.monotonic()) + self.spin_s
        deadline = call.start + call.timeout if call.timeout else float("inf")
        cancelled_at = None
        heartbeat = words[_HEARTBEAT]
        beat, beat_at = heartbeat.value, time.monotonic()
        while target.value != seq:
            if response.value == seq:
                return False
            if closed.value:
                if response.value == seq:
                    return False
                raise ChannelClosed()
            now = time.monotonic()
            if now > deadline and cancelled_at is None:
                # The server answers CANCELLED (or the result it had) soon.
                words[_CANCEL_SEQ].value = seq
                cancelled_at = now
            if cancelled_at is not None and now > cancelled_at + 10.0:
                raise FlceError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                "call channel: no answer after the deadline and a cancel")
            if heartbeat.value != beat:
                beat, beat_at = heartbeat.value, now
            elif now > beat_at + HEARTBEAT_LOST_S:
                raise FlceError(grpc.StatusCode.UNAVAILABLE,
                                f"call channel: the server stopped (no heartbeat for "
                                f"{HEARTBEAT_LOST_S:g} s)")
            if poll_from <= now < spin_until:
                os.sched_yield()  # lets other threads (and their GIL) run
                continue
            seen = target.value
            if seen == seq:
                break
            words[_CLIENT_WAITING].value = 1
            nap = min(poll_from - now, 0.05) if now < poll_from else 0.05
            wait = _Timespec(0, int(nap * 1e9))
            _futex()(_SYS_FUTEX, ctypes.c_void_p(ctypes.addressof(target)), _FUTEX_WAIT, seen,
                     ctypes.byref(wait), None, 0)
            words[_CLIENT_WAITING].value = 0
        return True

    def fence(self) -> int:
        """The address of the fence word (for a GPU stream's wait; the
        region must be registered with the GPU first)."""
        return ctypes.addressof(self._words[_FENCE_SEQ])

    def watch(self, call: "Call"):
        """Has a thread of this channel's store `call`'s fence itself if the
        server stops beating before answering it: a GPU stream waiting on the
        fence (queued work the caller synchronises with before it reads the
        answer) must not wait for a dead server forever. The thread looks
        every 0.1 s at the call last watched; nothing wakes it per call (a
        wake-up there would contend for the GIL with the caller's next
        steps)."""
        self._watched = call
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch_loop, daemon=True,
                                             name="flce-fence-watch")
            self._watcher.start()

    def _watch_loop(self):
        words = self._words
        call, beat, beat_at = None, 0, 0.0
        while not self._closing.wait(0.1):
            watched = self._watched
            if watched is None or words[_RESPONSE_SEQ].value == watched.seq or words[_CLOSED].value:
                call = None
                continue
            now = time.monotonic()
            if watched is not call or words[_HEARTBEAT].value != beat:
                call, beat, beat_at = watched, words[_HEARTBEAT].value, now
            elif now > beat_at + HEARTBEAT_LOST_S:
                words[_FENCE_SEQ].value = call.seq  # the GPU goes on
                beat_at = float("inf")  # once
        del words

    def close(self):
        """Closes the channel and frees its region (idempotent)."""
        self._closing.set()
        if self._watcher is not None:
            self._watcher.join()
            self._watcher = None
        for f in self.on_close:
            f()
        self.on_close = []
        client, self._client = self._client, None
        if client is not None and self.channel_id:
            try:
                client._call(client._stub.CloseCallChannel,
                             pb.CloseCallChannelRequest(channel_id=self.channel_id))
            except Exception:  # pragma: no cover - the server went away
                pass
        if self._region is not None:
            self._words = {}  # (their views of the mapping go first)
            self._timeout_us = None
            region, self._region = self._region, None
            try:
                region.close()
            except Exception:  # pragma: no cover - the server went away
                pass
