"""Large tensors over several connections at once.

Such bytes travel through a region of the server's own memory
(RegisterSharedMemory with server_memory), which the calls that use them
(PutWeight, TakeWeightGrad, the row pieces' Forward and Backward) then name
as a slice instead of carrying the bytes. They go into and out of the
region over the server's bulk HTTP port (:mod:`flce.bulk_http`), several
ranges at once on connections of their own. Where the server offers no
bulk port or it cannot be reached, they go as WriteRegion and ReadRegion
streams instead, one per connection, in parts that carry their CRC-32,
encoded and decoded here without protobuf's copies (one copy into each
outgoing message, one out of each incoming one): about 1 GB/s a
connection, less from Python.
"""

import concurrent.futures
import itertools
import logging
import struct
import threading
import time
import zlib
from typing import List, Optional

import grpc
import numpy as np

from flce import bulk_http
from flce_pb.v1 import loss_service_pb2 as pb

_log = logging.getLogger("flce")

_WRITE = "/flce.v1.LossService/WriteRegion"
WRITE_PART_BYTES = 1 << 20
_READ = "/flce.v1.LossService/ReadRegion"
# A transfer below 64 MiB (a row piece's X or dX) goes in at most 4 ranges,
# a larger one (a weight, its gradient) over every connection: over the bulk
# port on the H200 host's loopback 8 connections move 1 GiB faster than 4
# (take 0.158 against 0.193 s, put 0.168 against 0.192) and 16 MiB no faster
# or slower (bench/RESULTS.md). So a worker's pieces hold at most 4 streams
# each way in the gRPC fallback, as before, within the server's
# --max_streams for 8 workers.
SMALL_TRANSFER_BYTES = 64 << 20
SMALL_TRANSFER_RANGES = 4
# A bulk-port range carries at least this much: a 4 MiB row piece goes in 2
# ranges, not 4 of 1 MiB, each of which costs a request and a thread's
# wake-up (part of the client measured faster on an H100 host on
# 2026-12-05; bench/RESULTS.md).
MIN_RANGE_BYTES = 2 << 20


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_part(region_id: str, offset: int, data, with_crc: bool = True) -> bytes:
    """A serialized flce.v1.RegionPart around `data` (a bytes-like object)."""
    head = b""
    if region_id:
        rid = region_id.encode()
        head += b"\x0a" + _varint(len(rid)) + rid
    head += b"\x10" + _varint(offset)
    if with_crc:
        head += b"\x25" + struct.pack("<I", zlib.crc32(data))
    head += b"\x1a" + _varint(len(data))
    return head + data


def _read_varint(buf, at: int):
    value, shift = 0, 0
    while True:
        b = buf[at]
        at += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, at
        shift += 7
        if shift > 63:
            raise ValueError("a varint over ten bytes")


def decode_part(message: bytes):
    """(offset, crc32 or None, memoryview of the data) of a serialized
    RegionPart."""
    view = memoryview(message)
    at, offset, crc, data = 0, 0, None, view[0:0]
    while at < len(view):
        tag, at = _read_varint(view, at)
        field, kind = tag >> 3, tag & 7
        if kind == 0:
            value, at = _read_varint(view, at)
            if field == 2:
                offset = value
        elif kind == 2:
            n, at = _read_varint(view, at)
            if field == 3:
                data = view[at:at + n]
            at += n
        elif kind == 5:
            if field == 4:
                crc = struct.unpack_from("<I", view, at)[0]
            at += 4
        elif kind == 1:
            at += 8
        else:
            raise ValueError(f"a RegionPart with wire type {kind}")
    return offset, crc, data


class BulkTransfer:
    """Moves byte ranges to and from a region of the server's memory over
    ``connections`` connections at once: the server's bulk port where
    ``http`` gives its host, TLS context and server name and the server
    offers one, else gRPC streams on channels of their own (made by
    ``make_channel``) in parts of ``part_bytes``. ``region(n)`` gives a
    region of at least n bytes, made once and grown as needed."""

    def __init__(self, client, make_channel, connections: int = 4, part_bytes: int = 4 << 20,
                 http: Optional[tuple] = None):
        self._client = client
        self.connections = connections
        self.part_bytes = part_bytes
        self._make_channel = make_channel
        self._grpc = None  # (channels, write and read callables), made on first use
        # Callers' threads run one range each; the rest run here (a read and
        # a write at once, from several threads, may all be in flight).
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4 * connections,
                                                           thread_name_prefix="flce-bulk")
        self._lock = threading.Lock()
        # Each gRPC part's CRC-32, computed on both ends (a benchmark may
        # switch it off to see what it costs).
        self.checksums = True
        self._region: Optional[str] = None
        self._region_bytes = 0
        self._http_where = http  # (host, ssl context or None, server name) or None
        self._http: Optional[bulk_http.BulkHttp] = None
        self._ticket = ""
        self._pinned = None  # the region the port's address was pinned for
        self._http_off_until = 0.0  # after an unreachable port: gRPC until then
        # Whether the server's bulk reads wait for marks (read_marked).
        self.marks = False
        self._marks = itertools.count(1)

    def region(self, nbytes: int) -> str:
        """The id of this transfer's region of server memory, at least
        ``nbytes`` long (FlceError where the server offers none)."""
        with self._lock:
            if self._region is not None and self._region_bytes >= nbytes:
                return self._region
            if self._region is not None:
                self._unregister()
            size = max(nbytes, 1 << 20)
            response = self._client._call(
                self._client._stub.RegisterSharedMemory,
                pb.RegisterSharedMemoryRequest(server_memory=True, bytes=size))
            self._region, self._region_bytes = response.region_id, size
            self._ticket = response.bulk_ticket
            self.marks = response.bulk_marks
            if response.bulk_port and self._http_where is not None and (
                    self._http is None or self._http.port != response.bulk_port):
                host, tls, server_name = self._http_where
                if self._http is not None:
                    self._http.close()
                self._http = bulk_http.BulkHttp(host, response.bulk_port,
                                                timeout=self._client.timeout,
                                                max_connections=2 * self.connections,
                                                tls=tls, server_name=server_name)
            return self._region

    def _off_http(self, why):
        """Transfers go over gRPC for a minute: the bulk port is out of reach."""
        self._http_off_until = time.monotonic() + 60.0
        _log.warning("flce: %s; large tensors go over gRPC streams instead (slower)", why)

    @property
    def over_http(self) -> bool:
        """Whether transfers go over the server's bulk port now."""
        return (self._http is not None and bool(self._ticket)
                and time.monotonic() >= self._http_off_until)

    def _most_ranges(self, total: int) -> int:
        """How many connections a transfer of `total` bytes may use."""
        if total >= SMALL_TRANSFER_BYTES:
            return self.connections
        return min(self.connections, SMALL_TRANSFER_RANGES)

    def _http_ranges(self, total: int) -> List[range]:
        """`total` bytes in up to one range per connection, each at least
        MIN_RANGE_BYTES and 4 KiB-aligned; below SMALL_TRANSFER_BYTES in at
        most SMALL_TRANSFER_RANGES."""
        n = max(1, min(self._most_ranges(total), total // MIN_RANGE_BYTES))
        per = -(-total // n)                # ceil(total / n)
        per = -(-per // 4096) * 4096        # up to whole 4 KiB
        return [range(a, min(total, a + per)) for a in range(0, total, per)]

    def spans(self, total: int) -> List[range]:
        """The ranges a transfer of ``total`` bytes goes in now (each on a
        connection of its own; one range over gRPC): a caller that makes
        the bytes range by range (a copy off the GPU) hands each over as
        soon as it is made (``before`` of :meth:`write`)."""
        return self._http_ranges(total) if self.over_http else [range(0, total)]

    def _over_http(self, write: bool, region_id: str, offset: int, view: memoryview,
                   each=None, **marked) -> bool:
        """Writes ``view`` at ``offset`` of the region (or reads into it,
        with ``marked`` BulkHttp.get's mark arguments) over the bulk port,
        one range per connection, calling ``each`` with a range of ``view``
        before it goes (a write) or once it is here (a read); False (and
        gRPC for a minute) where the port cannot be reached."""
        if region_id != self._region or not self.over_http:
            return False
        if not len(view):
            return True
        ticket = self._ticket
        if self._pinned != region_id:
            # Which of the host's addresses holds the region (a name may
            # resolve to several servers).
            try:
                self._http.pin(region_id, ticket)
            except bulk_http.Unreachable as e:
                self._off_http(e)
                return False
            self._pinned = region_id
        spans = self._http_ranges(len(view))

        def one(span: range):
            part = view[span.start:span.stop]
            if write:
                if each is not None:
                    each(span)
                self._http.put(region_id, ticket, offset + span.start, part)
            else:
                self._http.get(region_id, ticket, offset + span.start, part, **marked)
                if each is not None:
                    each(span)

        futures = [self._pool.submit(one, span) for span in spans[1:]]
        error = None
        try:
            one(spans[0])
        except BaseException as e:  # the others finish first: they use `view`
            error = e
        for f in futures:
            try:
                f.result()
            except BaseException as e:
                error = error or e
        if isinstance(error, bulk_http.Unreachable):
            self._off_http(error)
            return False
        if error is not None:
            raise error
        return True

    def next_mark(self) -> int:
        """A mark no earlier call of this transfer used (not 0)."""
        with self._lock:
            return next(self._marks)

    def read_marked(self, region_id: str, offset: int, out, mark: int, timeout: float,
                    cancel: bulk_http.Cancel, landed=None) -> bool:
        """Reads like :meth:`read` once the server has posted ``mark`` on
        the region (the call that writes the bytes names it: waiting up to
        ``timeout``), unless ``cancel`` ends it (CANCELLED); an ABORTED
        FlceError where that call ended without writing them. False, and
        nothing read, where the server's reads do not wait for marks or its
        bulk port is out of reach: the caller reads after the call's
        answer."""
        if not self.marks:
            return False
        return self._over_http(False, region_id, offset, memoryview(out).cast("B"), landed,
                               after_mark=mark, wait_s=timeout, cancel=cancel)

    def _streams(self):
        """The gRPC fallback's channels and calls, made on first use."""
        with self._lock:
            if self._grpc is None:
                channels = [self._make_channel(i) for i in range(self.connections)]
                self._grpc = (channels, [c.stream_unary(_WRITE) for c in channels],
                              [c.unary_stream(_READ, request_serializer=pb.ReadRegionRequest.
                                              SerializeToString) for c in channels])
            return self._grpc

    def _ranges(self, total: int) -> List[range]:
        """`total` bytes split in one range per connection, whole parts each
        (at most SMALL_TRANSFER_RANGES below SMALL_TRANSFER_BYTES)."""
        n = self._most_ranges(total)
        parts = max(1, -(-total // self.part_bytes))
        per = -(-parts // n)
        return [range(i * per * self.part_bytes, min(total, (i + 1) * per * self.part_bytes))
                for i in range(n) if i * per * self.part_bytes < total]

    def write(self, region_id: str, offset: int, data, timeout: float, before=None):
        """Writes ``data`` (a bytes-like object) at ``offset`` of the region;
        ``before(span)``, where given, is called with each range of ``data``
        (``spans``) before that range goes, and returns once its bytes are
        there to send."""
        view = memoryview(data).cast("B")
        if self._over_http(True, region_id, offset, view, before):
            return
        if before is not None:
            before(range(0, len(view)))
        _, writes, _ = self._streams()
        # Smaller parts going up: 2.4–2.9 GB/s over 4 connections with 1 MiB
        # against 1.6–2.5 with 4 MiB on the H200 host (bench/RESULTS.md); the
        # reads are as fast with either.
        step = min(self.part_bytes, WRITE_PART_BYTES)

        def parts(span: range):
            first = True
            for at in range(span.start, span.stop, step):
                chunk = view[at:min(at + step, span.stop)]
                yield encode_part(region_id if first else "", offset + at, chunk, self.checksums)
                first = False

        calls = [writes[i].future(parts(span), timeout=timeout,
                                        metadata=self._client._metadata)
                 for i, span in enumerate(self._ranges(len(view)))]
        self._wait(calls, timeout, "WriteRegion")

    def read(self, region_id: str, offset: int, out, timeout: float, landed=None):
        """Reads ``len(out)`` bytes at ``offset`` of the region into ``out``
        (a writable bytes-like object); over gRPC each part's CRC-32 is
        checked. ``landed(span)``, where given, is called with each range
        of ``out`` once its bytes are there (over gRPC: all of it, at the
        end)."""
        view = memoryview(out).cast("B")
        if self._over_http(False, region_id, offset, view, landed):
            return
        self._read_streams(region_id, offset, view, timeout)
        if landed is not None:
            landed(range(0, len(view)))

    def _read_streams(self, region_id: str, offset: int, view: memoryview, timeout: float):
        from flce.client import FlceError

        _, _, reads = self._streams()
        # NumPy copies without the interpreter lock: the connections' threads
        # land their parts side by side.
        dest = np.frombuffer(view, dtype=np.uint8)

        def fetch(i: int, span: range):
            request = pb.ReadRegionRequest(region_id=region_id, offset=offset + span.start,
                                           length=len(span), part_bytes=self.part_bytes,
                                           crc32=self.checksums)
            got = 0
            try:
                for message in reads[i](request, timeout=timeout,
                                              metadata=self._client._metadata):
                    at, crc, data = decode_part(message)
                    if crc is not None and zlib.crc32(data) != crc:
                        raise FlceError(grpc.StatusCode.DATA_LOSS,
                                        f"ReadRegion: a part at offset {at} does not match its "
                                        "CRC-32")
                    start = at - offset
                    if start < span.start or start + len(data) > span.stop:
                        raise FlceError(grpc.StatusCode.INTERNAL,
                                        f"ReadRegion: a part at offset {at} outside the range "
                                        "asked for")
                    np.copyto(dest[start:start + len(data)], np.frombuffer(data, dtype=np.uint8))
                    got += len(data)
            except grpc.RpcError as e:
                raise FlceError(e.code(), e.details()) from None
            if got != len(span):
                raise FlceError(grpc.StatusCode.DATA_LOSS,
                                f"ReadRegion: {got} of {len(span)} bytes arrived")

        futures = [self._pool.submit(fetch, i, span)
                   for i, span in enumerate(self._ranges(len(view)))]
        try:
            for f in futures:
                f.result(timeout=timeout + 1.0)
        except concurrent.futures.TimeoutError:
            raise FlceError(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"ReadRegion did not finish within {timeout} s") from None

    def _wait(self, calls, timeout: float, what: str):
        from flce.client import FlceError

        try:
            for call in calls:
                call.result(timeout=timeout + 1.0)
        except grpc.FutureTimeoutError:
            for call in calls:
                call.cancel()
            raise FlceError(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"{what} did not finish within {timeout} s") from None
        except grpc.RpcError as e:
            for call in calls:
                call.cancel()
            raise FlceError(e.code(), e.details()) from None

    def _unregister(self):
        region, self._region, self._region_bytes = self._region, None, 0
        try:
            self._client._call(self._client._stub.UnregisterSharedMemory,
                               pb.UnregisterSharedMemoryRequest(region_id=region))
        except Exception:  # pragma: no cover - the server went away; the region goes with it
            pass

    def close(self):
        with self._lock:
            if self._region is not None:
                self._unregister()
        self._pool.shutdown(wait=False)
        if self._http is not None:
            self._http.close()
        for channel in self._grpc[0] if self._grpc else ():
            channel.close()
