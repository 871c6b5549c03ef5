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

Connections are kept alive and reused, at most ``max_connections`` busy at
once (a transfer beyond that waits for one). TLS exactly when the gRPC
channel has it, with its CAs and server name; TCP and TLS carry the
integrity of the bytes (no checksum of our own, as for any gRPC message).
A read may name a mark (``after_mark``): the server answers it once the
call that writes the bytes has posted that mark (a row piece's Forward,
which writes its dX: ``EagerBackward.written_mark``), so the read goes out
with the call instead of after its answer; :class:`Cancel` ends such reads
early. A name that resolves to several servers (a headless Service's, one address
per pod) is pinned to the address that holds the region (:meth:`pin`): the
gRPC channel reached one of them, and the region lives there.
"""

import socket
import ssl
import struct
import threading
from typing import Optional

import grpc

_CODES = {code.value[0]: code for code in grpc.StatusCode}
CONNECT_TIMEOUT = 5.0
MAX_WAIT_MS = 10 * 60 * 1000  # the server's bound on a read's wait for its mark


class Unreachable(Exception):
    """The bulk port could not be connected to (a firewall, a port not
    forwarded, a server at its connection limit): the caller moves the
    bytes over gRPC instead."""


class Cancel:
    """Ends the reads given it that are still in flight (their connections
    shut down; they raise CANCELLED): a read waiting for a mark whose call
    failed before the server saw it. Reads given it after :meth:`cancel`
    fail at once."""

    def __init__(self):
        self._lock = threading.Lock()
        self._conns = set()
        self.cancelled = False

    def cancel(self):
        with self._lock:
            self.cancelled = True
            conns, self._conns = self._conns, set()
        for conn in conns:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except (OSError, AttributeError):
                pass

    def _hold(self, conn) -> bool:
        with self._lock:
            if not self.cancelled:
                self._conns.add(conn)
            return not self.cancelled

    def _let_go(self, conn):
        with self._lock:
            self._conns.discard(conn)


class _Closed(Exception):
    """The server closed the connection without answering the request."""


class _Connection:
    """A keep-alive HTTP/1.1 connection to ``address`` (``host``'s, or host
    itself) that connects within CONNECT_TIMEOUT, then allows ``timeout``
    for each wait on the socket; TLS with ``tls`` (an ssl.SSLContext),
    checking the certificate against ``server_name``.

    Over plain TCP the socket blocks, its timeouts the kernel's
    (SO_SNDTIMEO, SO_RCVTIMEO): a body goes out in one ``sendall`` and comes
    in with one ``recv_into(MSG_WAITALL)``, one system call each with the
    interpreter lock released throughout. A socket with Python's own
    timeout is non-blocking underneath and takes the lock back for every
    socket buffer's worth (64-256 KiB), so a read beside a write in another
    thread of the same process ran at half speed (bench/RESULTS.md,
    2026-12-03's duplex probe). The server's answers are its own
    (server/bulk_http.cc): a status line, headers with Content-Length, a
    body of that length."""

    HEAD_BYTES = 64 << 10  # an answer's head is far shorter

    def __init__(self, host: str, address: str, port: int, timeout: float,
                 tls: Optional[ssl.SSLContext], server_name: str):
        self._host = f"[{host}]" if ":" in host else host
        self._address, self.port, self.timeout = address, port, timeout
        self._tls, self._server_name = tls, server_name
        self.sock = None

    def connect(self):
        sock = socket.create_connection((self._address, self.port), CONNECT_TIMEOUT)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock.settimeout(self.timeout)
                sock = self._tls.wrap_socket(sock, server_hostname=self._server_name)
            else:
                if self.timeout is not None:
                    seconds = int(self.timeout)
                    limit = struct.pack("ll", seconds, int((self.timeout - seconds) * 1e6))
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)
                sock.settimeout(None)
        except BaseException:
            sock.close()
            raise
        self.sock = sock

    def close(self):
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def exchange(self, method: str, path: str, headers: dict, body, out):
        """Sends the request and reads the answer: (status, headers with
        lower-case names, the body: into ``out`` on 200 when given, else
        as bytes, the first 4096 of an error's), and whether the server
        closes the connection after it. _Closed where it answered nothing."""
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self._host}:{self.port}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        try:
            self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
            if body is not None:
                self.sock.sendall(body)
        except (BrokenPipeError, ConnectionResetError):
            # The server answered before the body was all sent (a refusal)
            # and closed: its answer says why.
            pass
        except BlockingIOError:  # SO_SNDTIMEO passed
            raise socket.timeout(f"sending stalled for {self.timeout:g} s") from None
        status, answer, rest = self._head()
        length = answer.get("content-length", "0")
        if not length.isdigit():
            raise _HttpError(f"an answer's Content-Length {length[:40]!r}")
        length = int(length)
        closes = answer.get("connection", "").lower() == "close"
        if status == 200 and out is not None:
            if length != len(out):
                raise _HttpError(f"{length} bytes answered for {len(out)} asked")
            self._body(out, rest)
            return status, answer, None, closes
        if length > 4096:  # only an error's first words are read
            closes = True
        kept = bytearray(min(length, 4096))
        self._body(memoryview(kept), rest[:len(kept)])
        return status, answer, bytes(kept), closes

    def _recv_into(self, view: memoryview) -> int:
        try:
            if self._tls is None:
                return self.sock.recv_into(view, len(view), socket.MSG_WAITALL)
            return self.sock.recv_into(view, len(view))
        except BlockingIOError:  # SO_RCVTIMEO passed
            raise socket.timeout(f"no bytes for {self.timeout:g} s") from None

    def _head(self):
        buf = bytearray()
        while True:
            try:
                chunk = self.sock.recv(8192)
            except BlockingIOError:  # SO_RCVTIMEO passed
                raise socket.timeout(f"no answer for {self.timeout:g} s") from None
            if not chunk:
                if not buf:
                    raise _Closed("the server closed the connection without an answer")
                raise _HttpError("the answer's head was cut off")
            buf += chunk
            end = buf.find(b"\r\n\r\n")
            if end >= 0:
                break
            if len(buf) > self.HEAD_BYTES:
                raise _HttpError("an answer's head over 64 KiB")
        head = buf[:end].decode("latin-1").split("\r\n")
        parts = head[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
            raise _HttpError(f"not an HTTP answer: {head[0][:80]!r}")
        headers = {}
        for line in head[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        return int(parts[1]), headers, memoryview(buf)[end + 4:]

    def _body(self, out: memoryview, rest: memoryview):
        """``len(out)`` bytes of body into ``out``: those already read with
        the head (``rest``), then the socket's."""
        got = min(len(rest), len(out))
        out[:got] = rest[:got]
        while got < len(out):
            try:
                n = self._recv_into(out[got:])
            except OSError as e:
                raise _HttpError(f"{got} of {len(out)} bytes arrived: {e}") from None
            if not n:
                raise _HttpError(f"{got} of {len(out)} bytes arrived")
            got += n


class _HttpError(Exception):
    """An answer that is not the protocol's, or a body cut short."""


class BulkHttp:
    """The bulk port of one server (``host``, ``port``)."""

    def __init__(self, host: str, port: int, *, timeout: float, max_connections: int,
                 tls: Optional[ssl.SSLContext] = None, server_name: Optional[str] = None):
        self.host, self.port = host, port
        self._timeout = timeout
        self._tls = tls
        self._server_name = server_name or host
        self._slots = threading.BoundedSemaphore(max_connections)
        self._idle = []
        self._lock = threading.Lock()
        self._address = host  # the address connections go to (see pin)

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
                status = conn.exchange("GET", f"/v1/regions/{region_id}?length=0",
                                       {"Authorization": f"Bearer {ticket}"}, None, None)[0]
                if status == 200:
                    found = address
                    break
            except (OSError, _Closed, _HttpError):
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

    def get(self, region_id: str, ticket: str, offset: int, out: memoryview, after_mark: int = 0,
            wait_s: float = 0.0, cancel: Optional[Cancel] = None):
        """Reads ``len(out)`` bytes at ``offset`` of the region into ``out``;
        with ``after_mark``, once the server has that mark posted (waiting
        up to ``wait_s``, at most ten minutes), unless ``cancel`` ends it."""
        path = f"/v1/regions/{region_id}?offset={offset}&length={len(out)}"
        if after_mark:
            wait_ms = max(1, min(MAX_WAIT_MS, int(wait_s * 1000)))
            path += f"&after_mark={after_mark}&wait_ms={wait_ms}"
        self._request("GET", path, ticket, None, out, cancel)

    def _request(self, method: str, path: str, ticket: str, body, out,
                 cancel: Optional[Cancel] = None):
        try:
            self._request_on_a_connection(method, path, ticket, body, out, cancel)
        except Exception:
            if cancel is not None and cancel.cancelled:
                raise _error(grpc.StatusCode.CANCELLED, f"bulk {method}: cancelled") from None
            raise

    def _request_on_a_connection(self, method, path, ticket, body, out, cancel):
        headers = {"Authorization": f"Bearer {ticket}"}
        if body is not None:
            headers["Content-Length"] = str(len(body))

        def hold(conn):  # `cancel` may shut it down from now on
            if cancel is not None and not cancel._hold(conn):
                conn.close()
                raise _failure(method, "cancelled")

        with self._slots:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            try:
                if conn is not None:
                    hold(conn)
                    try:
                        status, answer, message, closes = conn.exchange(method, path, headers,
                                                                        body, out)
                    except (_Closed, ConnectionError):
                        # The server closed the kept connection while it was
                        # idle (--stream_idle_timeout): once more on a new one.
                        if cancel is not None:
                            cancel._let_go(conn)
                        conn.close()
                        conn = None
                    except (OSError, _HttpError) as e:
                        conn.close()
                        raise _failure(method, f"the connection broke: {e}") from None
                if conn is None:
                    conn = self._connect()
                    hold(conn)
                    try:
                        status, answer, message, closes = conn.exchange(method, path, headers,
                                                                        body, out)
                    except _Closed as e:
                        # A new connection closed without a word: a server at
                        # its connection limit.
                        conn.close()
                        raise Unreachable(f"the bulk port {self.host}:{self.port} closed a new "
                                          f"connection: {e}") from None
                    except (OSError, _HttpError) as e:
                        conn.close()
                        raise _failure(method, f"the connection broke: {e}") from None
            finally:
                if cancel is not None and conn is not None:
                    cancel._let_go(conn)
            if closes or status != 200:  # after a refusal, the body may still be in flight
                conn.close()
            else:
                with self._lock:
                    self._idle.append(conn)
            if status != 200:
                text = message.decode("utf-8", "replace").strip()
                code = _CODES.get(int(answer.get("flce-code", "2")), grpc.StatusCode.UNKNOWN)
                raise _error(code, f"bulk {method}: {text} (HTTP {status})")

    def close(self):
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


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
