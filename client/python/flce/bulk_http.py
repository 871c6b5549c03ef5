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

import http.client
import socket
import ssl
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
            if conn is not None:
                hold(conn)
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
                hold(conn)
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
            finally:
                if cancel is not None:
                    cancel._let_go(conn)
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
