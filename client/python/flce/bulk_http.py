"""The server's bulk port: a region of server memory's bytes over plain HTTP/1.1.

A region of server memory registered over gRPC comes with the port and a
ticket (RegisterSharedMemoryResponse.bulk_port, bulk_ticket); its bytes are
then written with ``PUT /v1/regions/<id>?offset=N`` and read with
``GET /v1/regions/<id>?offset=N&length=M``, the ticket as a bearer token
(server/bulk_http.h has the protocol). The body goes from the caller's
buffer into the socket and from the socket into the caller's buffer, with
the interpreter lock released for the copies: 8-18 GB/s over 4-8
connections on the H200 host's loopback, against 1-3 GB/s for the same
bytes as gRPC messages (bench/RESULTS.md).

A transfer goes in up to one range per connection, all at once. Where the
package has its native transfers (``libflce_bulk.so``, client/bulk_http_client.h
behind a C ABI, loaded with ctypes), a whole transfer is one call that
releases the interpreter lock until every range is over: a piece's X going
up while the last piece's dX comes down then run as two processes' would,
where Python's socket calls, each taking the lock back, halve both
(bench/RESULTS.md). ``FLCE_BULK_NATIVE=0`` turns them off;
``FLCE_BULK_LIBRARY`` names the library elsewhere.

Connections are kept alive and reused, at most ``max_connections`` busy at
once in Python (a transfer beyond that waits for one). TLS exactly when the gRPC
channel has it, with its CAs and server name; TCP and TLS carry the
integrity of the bytes (no checksum of our own, as for any gRPC message).
A name that resolves to several servers (a headless Service's, one address
per pod) is pinned to the address that holds the region (:meth:`pin`): the
gRPC channel reached one of them, and the region lives there.
"""

import concurrent.futures
import ctypes
import http.client
import os
import socket
import ssl
import sys
import threading
from typing import Optional

import grpc
import numpy as np

_CODES = {code.value[0]: code for code in grpc.StatusCode}
CONNECT_TIMEOUT = 5.0


class Unreachable(Exception):
    """The bulk port could not be connected to (a firewall, a port not
    forwarded, a server at its connection limit): the caller moves the
    bytes over gRPC instead."""


class _Connection(http.client.HTTPConnection):
    """A keep-alive connection to ``address`` (``host``'s, or host itself)
    that connects within CONNECT_TIMEOUT, then allows ``timeout`` for a
    whole request; TLS with ``tls`` (an ssl.SSLContext), checking the
    certificate against ``server_name``."""

    def __init__(self, host: str, address: str, port: int, timeout: float,
                 tls: Optional[ssl.SSLContext], server_name: str):
        super().__init__(host, port, timeout=timeout)
        self._address = address
        self._tls = tls
        self._server_name = server_name

    def connect(self):
        sock = socket.create_connection((self._address, self.port), CONNECT_TIMEOUT)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(self.timeout)
        if self._tls is not None:
            sock = self._tls.wrap_socket(sock, server_hostname=self._server_name)
        self.sock = sock


_ABI_VERSION = 1
_UNREACHABLE = -1
_library = None
_library_lock = threading.Lock()


def native_library():
    """The native transfers (a ctypes.CDLL), or None: turned off
    (FLCE_BULK_NATIVE=0), not in this package, or not loadable here."""
    global _library
    if os.environ.get("FLCE_BULK_NATIVE", "1") == "0":
        return None
    with _library_lock:
        if _library is None:
            _library = _load_library() or False
        return _library or None


def _load_library():
    named = os.environ.get("FLCE_BULK_LIBRARY")
    # Beside this file (an installed package), else in a flce/ folder on the
    # path (the source tree's bazel-bin/client/python).
    candidates = [named] if named else [
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "libflce_bulk.so")] + [
        os.path.join(entry or ".", "flce", "libflce_bulk.so") for entry in sys.path]
    for path in candidates:
        if not os.path.isfile(path):
            continue
        try:
            lib = ctypes.CDLL(path)
            if lib.flce_bulk_abi_version() != _ABI_VERSION:
                continue
        except (OSError, AttributeError) as e:
            import logging

            logging.getLogger("flce").warning(
                "flce: the native bulk transfers at %s do not load (%s); the bulk port's "
                "bytes move in Python instead", path, e)
            continue
        lib.flce_bulk_open.restype = ctypes.c_void_p
        lib.flce_bulk_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int,
                                       ctypes.c_char_p, ctypes.c_char_p, ctypes.c_double]
        lib.flce_bulk_move.restype = ctypes.c_int
        lib.flce_bulk_move.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p,
                                       ctypes.c_char_p, ctypes.c_int64, ctypes.c_void_p,
                                       ctypes.c_int64, ctypes.c_int, ctypes.c_char_p,
                                       ctypes.c_int64]
        lib.flce_bulk_pin.restype = ctypes.c_int
        lib.flce_bulk_pin.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p,
                                      ctypes.c_char_p, ctypes.c_int64]
        lib.flce_bulk_free.restype = None
        lib.flce_bulk_free.argtypes = [ctypes.c_void_p]
        return lib
    return None


class _Native:
    """A native client of one bulk port (libflce_bulk.so's handle), freed
    with the last reference to it."""

    def __init__(self, lib, host: str, port: int, timeout: float, tls: Optional[bytes],
                 server_name: str):
        self._lib = lib
        self._handle = lib.flce_bulk_open(host.encode(), port, tls is not None, tls or b"",
                                          server_name.encode(), timeout)
        if not self._handle:
            raise MemoryError("flce_bulk_open")

    @staticmethod
    def _check(code: int, message):
        if code == 0:
            return
        text = message.value.decode("utf-8", "replace")
        if code == _UNREACHABLE:
            raise Unreachable(text)
        raise _error(_CODES.get(code, grpc.StatusCode.UNKNOWN), text)

    def move(self, write: bool, region_id: str, ticket: str, offset: int, view: memoryview,
             ranges: int):
        if not write and view.readonly:
            raise ValueError("bulk GET: the destination buffer is read-only")
        # The buffer's address (a read-only one, bytes say, is fine for a
        # write: the library only reads it then); `array` keeps it alive.
        array = np.frombuffer(view, dtype=np.uint8)
        message = ctypes.create_string_buffer(1024)
        code = self._lib.flce_bulk_move(self._handle, write, region_id.encode(), ticket.encode(),
                                        offset, array.ctypes.data, array.nbytes, ranges,
                                        message, len(message))
        self._check(code, message)

    def pin(self, region_id: str, ticket: str):
        message = ctypes.create_string_buffer(1024)
        self._check(self._lib.flce_bulk_pin(self._handle, region_id.encode(), ticket.encode(),
                                            message, len(message)), message)

    def __del__(self):
        if getattr(self, "_handle", None):
            self._lib.flce_bulk_free(self._handle)
            self._handle = None


class BulkHttp:
    """The bulk port of one server (``host``, ``port``). ``tls``: None for
    plain TCP, else the PEM CAs to trust (b"": the system's)."""

    def __init__(self, host: str, port: int, *, timeout: float, max_connections: int,
                 tls: Optional[bytes] = None, server_name: Optional[str] = None,
                 native: bool = True):
        self.host, self.port = host, port
        self._timeout = timeout
        self._tls = tls_context(tls) if tls is not None else None
        self._server_name = server_name or host
        self._slots = threading.BoundedSemaphore(max_connections)
        self._idle = []
        self._lock = threading.Lock()
        self._address = host  # the address connections go to (see pin)
        lib = native_library() if native else None
        self._native = (_Native(lib, host, port, timeout, tls, self._server_name)
                        if lib is not None else None)
        self._pool = None  # threads for the ranges moved in Python, made on first use

    @property
    def native(self) -> bool:
        """Whether transfers move in native code."""
        return self._native is not None

    def move(self, write: bool, region_id: str, ticket: str, offset: int, view: memoryview,
             ranges: int):
        """Writes ``view`` at ``offset`` of the region (or reads into it) in
        up to ``ranges`` ranges at once, one per connection, each at least
        1 MiB and 4 KiB-aligned. Unreachable where the port cannot be
        connected to; FlceError for the server's refusal or a broken
        connection."""
        if not len(view):
            return
        native = self._native
        if native is not None:
            native.move(write, region_id, ticket, offset, view, ranges)
            return
        n = max(1, min(ranges, len(view) >> 20))
        per = -(-len(view) // n)            # ceil(total / n)
        per = -(-per // 4096) * 4096        # up to whole 4 KiB
        spans = [range(a, min(len(view), a + per)) for a in range(0, len(view), per)]
        transfer = self.put if write else self.get

        def one(span: range):
            transfer(region_id, ticket, offset + span.start, view[span.start:span.stop])

        with self._lock:
            if self._pool is None and len(spans) > 1:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    thread_name_prefix="flce-bulk-http")
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
        if error is not None:
            raise error

    def _connect(self, address: Optional[str] = None) -> _Connection:
        conn = _Connection(self.host, address or self._address, self.port, self._timeout,
                           self._tls, self._server_name)
        try:
            conn.connect()
        except (OSError, ssl.SSLError) as e:
            conn.close()
            raise Unreachable(f"the bulk port {self.host}:{self.port}: {e}") from None
        return conn

    def pin(self, region_id: str, ticket: str):
        """Connects from now on to the address of the host that holds the
        region: where the name resolves to one address, that one; else the
        first that answers for the ticket. Unreachable where none does."""
        native = self._native
        if native is not None:
            native.pin(region_id, ticket)
            return
        try:
            infos = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        except OSError as e:
            raise Unreachable(f"the bulk port's host {self.host}: {e}") from None
        addresses = list(dict.fromkeys(info[4][0] for info in infos))
        found = addresses[0] if len(addresses) == 1 else None
        for address in addresses if found is None else ():
            try:
                conn = self._connect(address)
            except Unreachable:
                continue
            try:
                resp = self._exchange(conn, "GET", f"/v1/regions/{region_id}?length=0",
                                      {"Authorization": f"Bearer {ticket}"}, None)
                resp.read()
                if resp.status == 200:
                    found = address
                    break
            except (OSError, http.client.HTTPException):
                pass
            finally:
                conn.close()
        if found is None:
            raise Unreachable(f"none of {self.host}'s addresses {addresses} holds the region on "
                              f"its bulk port {self.port}")
        if found != self._address:
            self.close()  # kept connections go elsewhere
            self._address = found

    def put(self, region_id: str, ticket: str, offset: int, data: memoryview):
        """Writes ``data`` at ``offset`` of the region."""
        self._request("PUT", f"/v1/regions/{region_id}?offset={offset}", ticket, data, None)

    def get(self, region_id: str, ticket: str, offset: int, out: memoryview):
        """Reads ``len(out)`` bytes at ``offset`` of the region into ``out``."""
        self._request("GET", f"/v1/regions/{region_id}?offset={offset}&length={len(out)}",
                      ticket, None, out)

    def _request(self, method: str, path: str, ticket: str, body, out):
        headers = {"Authorization": f"Bearer {ticket}"}
        if body is not None:
            headers["Content-Length"] = str(len(body))
        with self._slots:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is not None:
                try:
                    resp = self._exchange(conn, method, path, headers, body)
                except (http.client.RemoteDisconnected, ConnectionError):
                    # The server closed the kept connection while it was
                    # idle (--stream_idle_timeout): once more on a new one.
                    conn.close()
                    conn = None
                except (OSError, http.client.HTTPException) as e:
                    conn.close()
                    raise _failure(method, f"the connection broke: {e}") from None
            if conn is None:
                conn = self._connect()
                try:
                    resp = self._exchange(conn, method, path, headers, body)
                except http.client.RemoteDisconnected as e:
                    # A new connection closed without a word: a server at
                    # its connection limit.
                    conn.close()
                    raise Unreachable(f"the bulk port {self.host}:{self.port} closed a new "
                                      f"connection: {e}") from None
                except (OSError, http.client.HTTPException) as e:
                    conn.close()
                    raise _failure(method, f"the connection broke: {e}") from None
            try:
                self._settle(method, resp, out)
            except BaseException:
                conn.close()
                raise
            if resp.will_close:
                conn.close()
            else:
                with self._lock:
                    self._idle.append(conn)

    @staticmethod
    def _exchange(conn, method, path, headers, body):
        try:
            conn.request(method, path, body=body, headers=headers)
        except (BrokenPipeError, ConnectionResetError):
            # The server answered before the body was all sent (a refusal)
            # and closed: its answer says why.
            return conn.getresponse()
        return conn.getresponse()

    @staticmethod
    def _settle(method: str, resp, out):
        if resp.status != 200:
            message = resp.read(4096).decode("utf-8", "replace").strip()
            code = _CODES.get(int(resp.getheader("Flce-Code", "2")), grpc.StatusCode.UNKNOWN)
            raise _error(code, f"bulk {method}: {message} (HTTP {resp.status})")
        if out is None:
            resp.read()
            return
        got = 0
        try:
            while got < len(out):
                n = resp.readinto(out[got:])
                if not n:
                    break
                got += n
        except (OSError, http.client.HTTPException) as e:
            raise _failure(method, f"the connection broke after {got} of {len(out)} bytes: "
                                   f"{e}") from None
        if got != len(out):
            raise _failure(method, f"{got} of {len(out)} bytes arrived")

    def close(self):
        with self._lock:
            idle, self._idle = self._idle, []
            pool, self._pool = self._pool, None
        for conn in idle:
            conn.close()
        if pool is not None:
            pool.shutdown(wait=False)
        # (The native client's connections close with its last reference.)
        self._native = None


def _error(code, message):
    from flce.client import FlceError

    return FlceError(code, message)


def _failure(method: str, what: str):
    return _error(grpc.StatusCode.UNAVAILABLE, f"bulk {method}: {what}")


def tls_context(root_certificates: Optional[bytes]) -> ssl.SSLContext:
    """The context of a TLS bulk port: ``root_certificates`` (PEM) as the
    CAs to trust, or the system's."""
    return ssl.create_default_context(
        cadata=root_certificates.decode() if root_certificates else None)
