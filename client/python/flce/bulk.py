"""Large tensors over several connections at once.

One gRPC connection carries about 1 GB/s, less from Python; a 1 GiB weight
or gradient is seconds on one. Here such bytes travel through a region of
the server's own memory (RegisterSharedMemory with server_memory): written
by WriteRegion streams and read by ReadRegion streams, one per connection,
each over its own range, in parts that carry their CRC-32; the calls that
use them (PutWeight, TakeWeightGrad) then name a slice of the region instead
of carrying the bytes. The parts are encoded and decoded here without
protobuf's copies (one copy into each outgoing message, one out of each
incoming one).
"""

import concurrent.futures
import struct
import threading
import zlib
from typing import List, Optional

import grpc
import numpy as np

from flce_pb.v1 import loss_service_pb2 as pb

_WRITE = "/flce.v1.LossService/WriteRegion"
WRITE_PART_BYTES = 1 << 20
_READ = "/flce.v1.LossService/ReadRegion"


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
    ``connections`` connections at once (their own TCP connections, made by
    ``make_channel``), in parts of ``part_bytes``. ``region(n)`` gives a
    region of at least n bytes, made once and grown as needed."""

    def __init__(self, client, make_channel, connections: int = 4, part_bytes: int = 4 << 20):
        self._client = client
        self.connections = connections
        self.part_bytes = part_bytes
        self._channels = [make_channel(i) for i in range(connections)]
        self._writes = [c.stream_unary(_WRITE) for c in self._channels]
        self._reads = [c.unary_stream(_READ, request_serializer=pb.ReadRegionRequest.SerializeToString)
                       for c in self._channels]
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=connections,
                                                           thread_name_prefix="flce-bulk")
        self._lock = threading.Lock()
        # Each part's CRC-32, computed on both ends (a benchmark may switch
        # it off to see what it costs).
        self.checksums = True
        self._region: Optional[str] = None
        self._region_bytes = 0

    def region(self, nbytes: int) -> str:
        """The id of this transfer's region of server memory, at least
        ``nbytes`` long (FlceError where the server offers none)."""
        with self._lock:
            if self._region is not None and self._region_bytes >= nbytes:
                return self._region
            if self._region is not None:
                self._unregister()
            size = max(nbytes, 1 << 20)
            self._region = self._client._call(
                self._client._stub.RegisterSharedMemory,
                pb.RegisterSharedMemoryRequest(server_memory=True, bytes=size)).region_id
            self._region_bytes = size
            return self._region

    def _ranges(self, total: int) -> List[range]:
        """`total` bytes split in one range per connection, whole parts each."""
        parts = max(1, -(-total // self.part_bytes))
        per = -(-parts // self.connections)
        return [range(i * per * self.part_bytes, min(total, (i + 1) * per * self.part_bytes))
                for i in range(self.connections) if i * per * self.part_bytes < total]

    def write(self, region_id: str, offset: int, data, timeout: float):
        """Writes ``data`` (a bytes-like object) at ``offset`` of the region."""
        view = memoryview(data).cast("B")
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

        calls = [self._writes[i].future(parts(span), timeout=timeout,
                                        metadata=self._client._metadata)
                 for i, span in enumerate(self._ranges(len(view)))]
        self._wait(calls, timeout, "WriteRegion")

    def read(self, region_id: str, offset: int, out, timeout: float):
        """Reads ``len(out)`` bytes at ``offset`` of the region into ``out``
        (a writable bytes-like object), checking each part's CRC-32."""
        from flce.client import FlceError

        view = memoryview(out).cast("B")
        # NumPy copies without the interpreter lock: the connections' threads
        # land their parts side by side.
        dest = np.frombuffer(view, dtype=np.uint8)

        def fetch(i: int, span: range):
            request = pb.ReadRegionRequest(region_id=region_id, offset=offset + span.start,
                                           length=len(span), part_bytes=self.part_bytes,
                                           crc32=self.checksums)
            got = 0
            try:
                for message in self._reads[i](request, timeout=timeout,
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
        for channel in self._channels:
            channel.close()
