"""A typed Python client for flce.v1.LossService.

Tensors go in as NumPy arrays or PyTorch tensors and come back as NumPy
arrays (bf16 results as float32, which holds them exactly; use
``to_torch`` for a torch tensor in the original dtype). Every call has a
deadline; server errors raise :class:`FlceError` carrying the gRPC code.
"""

import dataclasses
import struct
import time
from typing import Optional, Sequence

import grpc
import numpy as np

from flce import bulk_http as _bulk_http
from flce import call_channel as _call_channel
from flce.shared_memory import SharedMemoryRegion
from flce.wire_dtypes import NP_DTYPES as _NP_DTYPES
from flce.wire_dtypes import elem_size as _elem_size
from flce.wire_dtypes import is_cuda as _is_cuda
from flce.wire_dtypes import wire_dtype as _wire_dtype
from flce_pb.v1 import loss_service_pb2 as pb
from flce_pb.v1 import loss_service_pb2_grpc as pb_grpc

import zlib


class FlceError(Exception):
    """A failed call: ``code`` is the grpc.StatusCode, ``details`` the message."""

    def __init__(self, code, details):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


_REDUCTIONS = {"mean": pb.REDUCTION_MEAN, "sum": pb.REDUCTION_SUM, "none": pb.REDUCTION_NONE}
_MODES = {
    "auto": pb.BACKWARD_MODE_AUTO,
    "store_grads": pb.BACKWARD_MODE_STORE_GRADS,
    "recompute": pb.BACKWARD_MODE_RECOMPUTE,
}
_MODE_NAMES = {v: k for k, v in _MODES.items()}

DEFAULT_PORT = 50051


def with_default_port(target: str) -> str:
    """``target`` with ":50051" added when it names a host without a port
    ("localhost", "10.0.0.7", "[::1]", "::1", "dns:///flce.svc"; gRPC would
    dial 443). Targets with a port and other schemes are kept as they are."""
    prefix, host = "", target
    if target.startswith("dns:///"):
        prefix, host = "dns:///", target[len("dns:///"):]
    elif ":/" in target or target.startswith(("unix:", "unix-abstract:", "vsock:")):
        return target
    if not host:
        return target
    if host.startswith("["):
        return f"{prefix}{host}:{DEFAULT_PORT}" if host.endswith("]") else target
    colons = host.count(":")
    if colons == 0:
        return f"{prefix}{host}:{DEFAULT_PORT}"
    if colons > 1:
        return f"{prefix}[{host}]:{DEFAULT_PORT}"
    return target


def target_host(target: str) -> Optional[str]:
    """The host a gRPC target dials ("10.0.0.7", "::1", "flce.svc"), or
    None for a target that is not a host and port (unix: and the like)."""
    target = with_default_port(target)
    if target.startswith("dns:///"):
        target = target[len("dns:///"):]
    elif ":/" in target or target.startswith(("unix:", "unix-abstract:", "vsock:")):
        return None
    host = target.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host or None


def check_loss_options(*, reduction: str = "mean", backward_mode: str = "auto",
                       label_smoothing: float = 0.0, logit_softcap: Optional[float] = None,
                       z_loss_scale: float = 0.0):
    """Raises ValueError naming the argument and its choices for an option
    the server would refuse; the checks the server makes, made early."""
    if reduction not in _REDUCTIONS:
        raise ValueError(
            f"reduction={reduction!r}: choose one of {', '.join(map(repr, _REDUCTIONS))}")
    if backward_mode not in _MODES:
        raise ValueError(
            f"backward_mode={backward_mode!r}: choose one of {', '.join(map(repr, _MODES))}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing!r}: must be in [0, 1)")
    if logit_softcap is not None and not logit_softcap > 0:
        raise ValueError(f"logit_softcap={logit_softcap!r}: must be > 0 (None: no softcap)")
    if not z_loss_scale >= 0:
        raise ValueError(f"z_loss_scale={z_loss_scale!r}: must be >= 0")


def set_loss_options(o: "pb.LossOptions", *, ignore_index: int, reduction: str,
                     label_smoothing: float, logit_softcap: Optional[float],
                     z_loss_scale: float):
    """Fills a LossOptions (all but class_weight, a tensor)."""
    o.ignore_index = ignore_index
    o.reduction = _REDUCTIONS[reduction]
    o.label_smoothing = label_smoothing
    if logit_softcap is not None:
        o.logit_softcap = logit_softcap
    o.z_loss_scale = z_loss_scale


def future_result(call, timeout: float, what: str):
    """The answer of a gRPC call's future, waited for with the deadline on
    this side too (the blocking form can stay stuck past its deadline in a
    write that a dead link never completes, seen with grpcio 1.51); errors
    as FlceError."""
    try:
        return call.result(timeout=timeout + 1.0)
    except grpc.FutureTimeoutError:
        call.cancel()
        raise FlceError(grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"{what} did not finish within {timeout} s") from None
    except grpc.RpcError as e:
        raise FlceError(e.code(), e.details()) from None


def wire_scalar(tensor: "pb.Tensor") -> float:
    """The value of a scalar fp32 wire Tensor (exact as a Python float)."""
    return struct.unpack("<f", tensor.data)[0]


_GRADIENT_SETS = {"all": pb.GRADIENTS_ALL, "hidden": pb.GRADIENTS_HIDDEN,
                  "weight": pb.GRADIENTS_WEIGHT}


def weight_checksum(payload: bytes) -> dict:
    """The WeightHeader field that checks ``payload``: zlib's CRC-32, which
    every Python computes in C (4.4 GB/s on the development VM, against 1.9
    for Debian's python3-crc32c there and minutes for a pure-Python CRC-32C
    of a gigabyte)."""
    return {"crc32": zlib.crc32(payload)}


def to_wire(tensor, out: Optional["pb.Tensor"] = None) -> "pb.Tensor":
    """A NumPy array or torch tensor as a wire Tensor (bf16 stays bf16)."""
    out = out if out is not None else pb.Tensor()
    dtype, shape, raw = _host_bytes(tensor)
    out.dtype = dtype
    del out.shape[:]
    out.shape.extend(shape)
    out.data = raw.tobytes()
    return out


def _host_bytes(tensor):
    """(wire dtype, shape, contiguous CPU array of its bytes) of a NumPy
    array or torch tensor, without a copy where it is one already."""
    if hasattr(tensor, "detach"):  # torch
        import torch

        t = tensor.detach().to("cpu").contiguous()
        if t.dtype == torch.bfloat16:
            return pb.DTYPE_BFLOAT16, list(t.shape), t.view(torch.int16).numpy().view(np.uint8)
        arr = t.numpy()
    else:
        arr = np.ascontiguousarray(tensor)
        arr = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
    return _wire_dtype(arr.dtype), list(arr.shape), arr.reshape(-1).view(np.uint8)


def _writable_bytes(buffer, nbytes: int, what: str) -> memoryview:
    """The bytes of a writable contiguous CPU buffer (torch or NumPy) that
    must hold exactly ``nbytes``."""
    if hasattr(buffer, "detach"):  # torch
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ValueError(f"{what}: a contiguous CPU tensor")
        import torch

        buffer = (buffer.reshape(-1).view(torch.uint8).numpy() if buffer.numel()
                  else np.empty(0, np.uint8))
    view = memoryview(buffer).cast("B")
    if view.nbytes != nbytes or view.readonly:
        raise ValueError(f"{what}: {view.nbytes} writable bytes, the gradient has {nbytes}")
    return view


def from_wire(tensor: "pb.Tensor") -> np.ndarray:
    """A wire Tensor as a NumPy array (bf16 widened exactly to float32)."""
    shape = tuple(tensor.shape)
    if tensor.dtype == pb.DTYPE_BFLOAT16:
        bits = np.frombuffer(tensor.data, dtype="<u2").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    return np.frombuffer(tensor.data, dtype=np.dtype(_NP_DTYPES[tensor.dtype]).newbyteorder("<")).reshape(shape)


def to_torch(tensor: "pb.Tensor", device="cpu"):
    """A wire Tensor as a torch tensor in its own dtype (bf16 stays bf16)."""
    import torch

    shape = tuple(tensor.shape)
    if tensor.dtype == pb.DTYPE_BFLOAT16:
        raw = np.frombuffer(tensor.data, dtype="<i2").copy()
        return torch.from_numpy(raw).view(torch.bfloat16).reshape(shape).to(device)
    return torch.from_numpy(from_wire(tensor).copy()).to(device)


@dataclasses.dataclass
class ForwardResult:
    loss: pb.Tensor            # fp32: [] for mean/sum, [N] for none
    z_loss: pb.Tensor
    lse: Optional[pb.Tensor]
    num_valid: int
    num_correct: int
    session_id: str
    backward_mode: str
    stats: Optional[pb.CallStats] = None  # the server's queue and engine time
    # With backward_into: the gradients (written into those tensors).
    gradients: Optional["Gradients"] = None
    # With vocab_shard: the shard's per-row statistics (loss and z_loss are
    # then empty; see flce.vocab_parallel).
    shard_stats: Optional["pb.ShardStats"] = None


@dataclasses.dataclass
class Gradients:
    grad_hidden: Optional[pb.Tensor]  # None after gradients="weight"
    grad_weight: Optional[pb.Tensor]  # None when accumulated on the server
    grad_bias: Optional[pb.Tensor]
    stats: Optional[pb.CallStats] = None


class PendingForward:
    """A Forward in flight (Client.forward with ``asynchronous=True``):
    ``result()`` waits for it and returns its ForwardResult, or raises its
    FlceError. Holds what the server reads (the request, the inputs' memory,
    the ready event) until the answer."""

    def __init__(self, client, ipc):
        self.request = pb.ForwardRequest()
        self.inputs = None  # the tensors the server reads, alive until the answer
        self.released = []  # release_sessions the request carries
        self.token = None  # the ready event, given back once the answer is in
        self._client, self._ipc = client, ipc
        self._channel = self._call = None
        self._result = self._error = None
        self._over = False
        # Its session is nobody's once it is made (the graph went first).
        self.release_when_done = False

    def submit(self, channel, device):
        """Makes the call through `channel`; once the server accepted it,
        the device's current stream waits for the answer (the fence)."""
        call = channel.submit(_call_channel.FORWARD, self.request, pb.ForwardResponse,
                              self._client.timeout)
        # (Closed before it was taken: not made, the caller may go elsewhere.)
        accepted = channel.accepted(call)
        self._channel, self._call = channel, call
        self._client._pending = self
        if accepted:
            self._ipc.wait_fence(channel, call.seq, device)
            channel.watch(call)
        else:
            self.result()  # answered already (a refusal): raise it now

    def done(self) -> bool:
        return self._over

    def wait(self):
        """Reads the answer (waiting for it) without raising its error."""
        if self._over:
            return
        client = self._client
        if client._pending is self:
            client._pending = None
        try:
            self.settle(self._channel.finish(self._call))
        except FlceError as e:
            self._error = e
            self.fail()
        except _call_channel.ChannelClosed:
            self._error = FlceError(grpc.StatusCode.UNAVAILABLE,
                                    "call channel: closed by the server during the call")
            self.fail()

    def result(self) -> ForwardResult:
        self.wait()
        if self._error is not None:
            raise self._error
        return self._result

    def error(self) -> Optional["FlceError"]:
        """The call's error once it is over (None: none, or not over)."""
        return self._error

    def settle(self, response):
        self._result = self._client._forward_result(self.request, response)
        self._end()
        if self.release_when_done and self._result.session_id:
            self._client.release_session_later(self._result.session_id)

    def fail(self):
        """The call failed (or was never made): its session releases go
        out with the next call."""
        if self._over:
            return
        self._client._deferred_releases.extend(self.released)
        self._end()

    def _end(self):
        self._over = True
        if self._client._pending is self:
            self._client._pending = None
        ipc, self.inputs = self._ipc, None
        if self.token is not None:
            ipc.done(self.token)
            self.token = None
        if ipc is not None and not ipc.keep:
            ipc.release_allocations()


class _HostCopy:
    """Page-locked host memory for a CUDA tensor of one dtype and size:
    ``start(tensor)`` copies it there behind the work queued on the current
    stream; ``result()`` waits for that copy alone and returns the memory
    (valid until the next start)."""

    def __init__(self, like):
        import torch

        self._host = torch.empty(like.shape, dtype=like.dtype, pin_memory=True).reshape(-1)
        self._copied = torch.cuda.Event()

    def start(self, tensor):
        import torch

        self._shape = tensor.shape
        self._host.copy_(tensor.detach().reshape(-1), non_blocking=True)
        self._copied.record(torch.cuda.current_stream(tensor.device))

    def result(self):
        self._copied.synchronize()
        return self._host.view(self._shape)


class HostStaging:
    """Copies of CUDA tensors to page-locked host memory kept by dtype,
    size and device (at most ``max_kept``, the oldest dropped first), for
    small tensors a call reads on the host each time (targets, an upstream
    gradient): no page-locked allocation per call, and the copy runs beside
    the caller's other work."""

    def __init__(self, max_kept: int = 8):
        self._kept = {}
        self._max_kept = max_kept

    def start(self, tensor) -> _HostCopy:
        """Starts ``tensor``'s copy (behind the work queued on the current
        stream); the returned copy's ``result()`` is valid until the next
        start of a tensor like it."""
        key = (tensor.dtype, tensor.numel(), tensor.device)
        copy = self._kept.get(key)
        if copy is None:
            if len(self._kept) >= self._max_kept:
                self._kept.pop(next(iter(self._kept)))
            copy = self._kept[key] = _HostCopy(tensor)
        copy.start(tensor)
        return copy


class Client:
    """A connection to one flce server ("host:port").

    A host without a port means port 50051. Plaintext unless ``tls`` (or
    any of the TLS arguments) is given: ``root_certificates`` are the CAs to
    trust (None: the system's); ``certificate_chain`` and ``private_key``
    are this client's certificate for a server that requires one (mutual
    TLS); ``server_name`` is the name the server's certificate must carry
    when it is not the host dialled (a pod dialled by IP whose certificate
    names its Service). ``token`` is sent as "authorization: Bearer
    <token>" on every call. ``cuda_ipc_keep_registrations=False`` registers
    GPU memory per call (see :class:`flce.cuda_ipc.CudaIpcRegistry`).
    ``call_channel``: "auto" makes the calls that pass tensors through
    shared memory or CUDA IPC through a call channel (see
    :mod:`flce.call_channel`) where the server offers one, True makes every
    Forward, Backward and ReleaseSession so, False none;
    ``call_channel_spin`` is how long such a call polls for its answer
    before it sleeps. Weights and their gradients of at least
    ``bulk_threshold`` bytes (1 MiB: from there on the bulk port beat
    gRPC's messages at every size measured, whose fresh buffers per call
    cost most on a VM; bench/RESULTS.md, 2026-12-04), and the drop-in's
    X and dX that large, travel over ``bulk_connections`` connections at
    once (at most 4 for less than 64 MiB, such as a row piece's X), through
    a region of the server's memory (see :mod:`flce.bulk`;
    0 connections: over the one channel, as chunks of one stream): over the
    server's bulk HTTP port where it offers one and ``bulk_http`` (TLS like
    the channel, without a client certificate: a region's ticket is its
    credential), else as gRPC streams. That region serves one call at a
    time: calls that move large tensors from several threads at once each
    need a Client of their own (their bytes would overwrite each other's)."""

    def __init__(self, target: str, timeout: float = 300.0,
                 max_message_bytes: int = 256 << 20, stream_chunk_bytes: int = 4 << 20, *,
                 tls: bool = False, root_certificates: Optional[bytes] = None,
                 certificate_chain: Optional[bytes] = None, private_key: Optional[bytes] = None,
                 server_name: Optional[str] = None, token: Optional[str] = None,
                 cuda_ipc_keep_registrations: bool = True, call_channel="auto",
                 call_channel_spin: float = 0.25, bulk_connections: int = 8,
                 bulk_threshold: int = 1 << 20, bulk_http: bool = True):
        options = [("grpc.max_send_message_length", max_message_bytes),
                   ("grpc.max_receive_message_length", max_message_bytes)]
        target = with_default_port(target)
        credentials = None
        if tls or root_certificates or certificate_chain or server_name:
            if server_name:
                options.append(("grpc.ssl_target_name_override", server_name))
            credentials = grpc.ssl_channel_credentials(root_certificates, private_key,
                                                       certificate_chain)

        def make_channel(connection: Optional[int] = None):
            # Each bulk connection its own TCP connection (gRPC would
            # otherwise share one subchannel among channels to one target).
            extra = [] if connection is None else [("grpc.use_local_subchannel_pool", 1),
                                                   ("flce.bulk_connection", connection)]
            if credentials is not None:
                return grpc.secure_channel(target, credentials, options=options + extra)
            return grpc.insecure_channel(target, options=options + extra)

        self._make_channel = make_channel
        host = target_host(target) if bulk_http else None
        self._bulk_http_where = None if host is None else (
            host, None if credentials is None else _bulk_http.tls_context(root_certificates),
            server_name or host)
        self._channel = make_channel()
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._stub = pb_grpc.LossServiceStub(self._channel)
        self._sessions = {}  # session id → (N, H, V, has_bias, dtype), for shm layouts
        self._lost_takes = {}  # weight name → a take that did not arrive whole
        self._releases = []  # ReleaseSession calls in flight
        self._deferred_releases = []  # sessions the next forward() releases
        self._staging = HostStaging()  # for CUDA targets
        self._cuda_ipc = None  # the CudaIpcRegistry, made on first use
        self._cuda_ipc_keep = cuda_ipc_keep_registrations
        if call_channel not in ("auto", True, False):
            raise ValueError(f"call_channel={call_channel!r}: choose 'auto', True or False")
        self._channel_mode = call_channel
        self._channel_spin = call_channel_spin
        self._open_channel = None  # the CallChannel, opened on first use
        self._bulk = None  # the BulkTransfer, made on first use
        self._bulk_connections = bulk_connections
        self._bulk_threshold = bulk_threshold
        self._bulk_refused_at = None  # when the server last refused a region
        self._weights = {}  # name → (V, H, has_bias, wire dtype) of the weights put
        self._pending = None  # a Forward of the channel's whose answer is still to be read
        self._channel_refused_at = None  # when the server last refused one
        self._held_call = None  # see hold_channel_thread()
        self.timeout = timeout
        self.max_message_bytes = max_message_bytes
        self.stream_chunk_bytes = stream_chunk_bytes

    def hold_channel_thread(self):
        """Keeps one call open on the channel (grpc.health.v1's Watch, which
        the server answers once and then holds) so that gRPC's thread that
        completes the channel's ``future()`` calls stays: with no call in
        flight that thread ends, and the next ``future()`` starts it anew and
        waits until it runs. Callers that make calls back to back (the row
        pieces') hold it; ``close()`` ends the call. The server ends open
        watches when it shuts down (the next call here opens another); one
        that refuses them (its ``--max_health_watches`` reached, or no Watch
        at all) is not asked again by this client."""
        held = self._held_call
        if held is False:
            return
        if held is not None and held.done():
            if held.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED,
                               grpc.StatusCode.UNIMPLEMENTED):
                self._held_call = False
                return
            held = None
        if held is None:
            watch = self._channel.unary_stream("/grpc.health.v1.Health/Watch")
            self._held_call = watch(b"", metadata=self._metadata)

    def cuda_ipc(self):
        """This client's :class:`flce.cuda_ipc.CudaIpcRegistry`: the GPU
        allocations and events it has registered with the server."""
        if self._cuda_ipc is None:
            from flce.cuda_ipc import CudaIpcRegistry

            self._cuda_ipc = CudaIpcRegistry(self, keep=self._cuda_ipc_keep)
        return self._cuda_ipc

    def bulk(self, nbytes: int):
        """This client's :class:`flce.bulk.BulkTransfer` for ``nbytes``, or
        None where they go over the one channel (small, disabled, or a server
        that refused a region: asked again after a minute)."""
        if self._bulk_connections <= 0 or nbytes < self._bulk_threshold:
            return None
        refused = self._bulk_refused_at
        if refused is not None and time.monotonic() < refused + 60.0:
            return None
        if self._bulk is None:
            from flce.bulk import BulkTransfer

            self._bulk = BulkTransfer(self, self._make_channel, self._bulk_connections,
                                      part_bytes=min(self.stream_chunk_bytes,
                                                     self.max_message_bytes - (64 << 10)),
                                      http=self._bulk_http_where)
        return self._bulk

    def _bulk_region(self, nbytes: int):
        """(bulk transfer, region id) for ``nbytes``, or None (see bulk())."""
        bulk = self.bulk(nbytes)
        if bulk is None:
            return None
        try:
            return bulk, bulk.region(nbytes)
        except FlceError as e:
            if e.code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNIMPLEMENTED,
                          grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
                self._bulk_refused_at = time.monotonic()
                return None
            raise

    def _bulk_write(self, tensor, out: "pb.Tensor") -> bool:
        """Writes ``tensor``'s bytes at the start of the bulk transfer's
        region and points ``out`` at them (True); False where they are to go
        in the message (under the bulk threshold, or no region)."""
        nbytes = tensor.numel() * tensor.element_size() if hasattr(tensor, "numel") else \
            np.asarray(tensor).nbytes
        found = self._bulk_region(nbytes) if nbytes else None
        if found is None:
            return False
        transfer, region = found
        dtype, shape, raw = _host_bytes(tensor)
        transfer.write(region, 0, raw, self.timeout)
        out.dtype = dtype
        del out.shape[:]
        out.shape.extend(shape)
        out.shm.region_id = region
        out.shm.offset = 0
        return True

    def close(self):
        self._settle_pending()
        if self._held_call:
            self._held_call.cancel()
        self._held_call = None
        if self._bulk is not None:
            self._bulk.close()
            self._bulk = None
        if self._open_channel is not None:
            self._open_channel.close()
            self._open_channel = None
        self._flush_releases()
        if self._cuda_ipc is not None:
            try:
                self._cuda_ipc.close()
            except Exception:  # pragma: no cover - the server went away
                pass
            self._cuda_ipc = None
        for pending in self._releases:  # let the sessions' releases go out
            try:
                pending.result(timeout=1)
            except Exception:  # pragma: no cover - the server went away
                pass
        self._releases = []
        self._channel.close()

    def create_shared_memory(self, nbytes: int) -> SharedMemoryRegion:
        """A shared-memory region of ``nbytes`` registered with the server."""
        return SharedMemoryRegion(self, nbytes)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def call_channel(self):
        """This client's open :class:`flce.call_channel.CallChannel`, opened
        now if need be; None where the server or the platform offers none."""
        channel = self._open_channel
        if channel is not None and not channel.broken:
            return channel
        if channel is not None:  # closed by the server (idle, shutdown): a new one
            channel.close()
            self._open_channel = None
        refused = self._channel_refused_at
        if not _call_channel.supported() or (refused is not None and
                                             time.monotonic() < refused + 60.0):
            return None
        try:
            self._open_channel = _call_channel.CallChannel(self, spin_s=self._channel_spin)
        except (FlceError, OSError):
            # No shared memory or channels there (or their bound reached):
            # gRPC, and ask again in a minute.
            self._channel_refused_at = time.monotonic()
            return None
        return self._open_channel

    def _unary(self, rpc: str, method: int, request, response_type, same_host: bool):
        """One Forward, Backward or ReleaseSession: through the call channel
        when this client uses one for such a call, else (or when the channel
        could not take it) through gRPC."""
        self._settle_pending()
        mode = self._channel_mode
        # (A session release goes the way its Forward went.)
        if mode is True or (mode == "auto" and (same_host or (
                method == _call_channel.RELEASE_SESSION and self._open_channel is not None))):
            channel = self.call_channel()
            if channel is not None:
                start = time.perf_counter()
                try:
                    return channel.call(method, request, response_type, self.timeout)
                except (_call_channel.ChannelClosed, ValueError, BlockingIOError):
                    pass  # not made: through gRPC
                finally:
                    self.last_call_ms = (time.perf_counter() - start) * 1e3
        return self._call(getattr(self._stub, rpc), request)

    def _call(self, method, request):
        start = time.perf_counter()
        try:
            return method(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise FlceError(e.code(), e.details()) from None
        finally:
            # Wall time of the last unary call (for benchmarks' breakdowns).
            self.last_call_ms = (time.perf_counter() - start) * 1e3

    def forward(self, hidden, target, weight=None, bias=None, *, weight_name: str = "",
                weight_version: int = 0, class_weight=None, ignore_index: int = -100,
                reduction: str = "mean", label_smoothing: float = 0.0,
                logit_softcap: Optional[float] = None, z_loss_scale: float = 0.0,
                need_backward: bool = False, backward_mode: str = "auto",
                want_lse: bool = False, want_per_row_loss: bool = False,
                shm: Optional[SharedMemoryRegion] = None,
                cuda_ipc: bool = False, backward_into=None,
                backward_grad_output: Optional[float] = None, loss_out=None,
                asynchronous: bool = False, vocab_shard: Optional[tuple] = None,
                bulk_hidden: bool = False):
        """Forward. Pass ``weight`` (and ``bias``), or ``weight_name`` of a
        registered weight. ``bulk_hidden``: hidden of at least the client's
        bulk threshold travels over the bulk connections into a region of
        the server's memory that the call reads, instead of in its message
        (without ``shm`` or ``cuda_ipc``). ``need_backward`` keeps a session
        for backward().
        With ``shm``, the tensors travel through that shared-memory region;
        with ``cuda_ipc``, hidden and weight on the GPU are read by the
        server from this process's GPU memory, in stream order after the
        work queued before the call (see :mod:`flce.cuda_ipc`); keep them
        alive and unchanged until the session's last backward(), which may
        read them again. With
        ``backward_into`` = (dX, dW, db) CUDA tensors (db None without a
        bias) and ``cuda_ipc``, the same call also runs Backward for the
        upstream gradient ``backward_grad_output`` (None: 1) and writes the
        gradients there (``ForwardResult.gradients``); the session is kept
        for a Backward with another grad_output, and is the caller's to
        release. ``loss_out``, a contiguous fp32 CUDA tensor of the loss's
        shape ([] or [N]), receives the loss too (with ``cuda_ipc``).

        Returns the ForwardResult; with ``asynchronous=True`` a
        :class:`PendingForward` instead, as soon as the server has accepted
        the call when it goes through a call channel with ``cuda_ipc`` (the
        device's current stream then waits on the GPU for the server's
        answer, so work queued on it afterwards sees the gradients and
        ``loss_out``; errors of the computation itself come from the
        pending call's ``result()``), or once it is done otherwise.

        ``vocab_shard`` = (first, full_vocab): ``weight`` (and ``bias``) are
        the rows [first, first + V_s) of a vocabulary of full_vocab ids; the
        result then carries ``shard_stats`` instead of a loss, and the
        session's backward() needs ``global_lse`` (see
        :mod:`flce.vocab_parallel`, which does this for a torch.distributed
        job)."""
        check_loss_options(reduction=reduction, backward_mode=backward_mode,
                           label_smoothing=label_smoothing, logit_softcap=logit_softcap,
                           z_loss_scale=z_loss_scale)
        self._settle_pending()
        ipc = self.cuda_ipc() if cuda_ipc and (_is_cuda(hidden) or _is_cuda(weight)) else None
        pending = PendingForward(self, ipc)
        # Through CUDA IPC only the targets travel as bytes: their copy to
        # the host starts now and runs beside the request's assembly.
        target_copy = (self._staging.start(target) if ipc is not None and shm is None
                       and _is_cuda(target) else None)
        try:
            r = pending.request
            released, self._deferred_releases = self._deferred_releases, []
            r.release_sessions.extend(released[:64])
            self._deferred_releases.extend(released[64:])
            pending.released = released[:64]
            if ipc is not None:
                ipc.sweep()
            # Tensors go into the region (one copy each) or the message.
            offset = 0

            def put(tensor, out):
                nonlocal offset
                if shm is None:
                    to_wire(tensor, out)
                else:
                    offset = shm.write(tensor, out, offset)

            # Contiguous copies (if any) live until the call is over: the
            # server reads them.
            if ipc is not None and _is_cuda(hidden):
                hidden = hidden.contiguous()
                ipc.place(hidden, r.hidden)
            elif not (bulk_hidden and shm is None and ipc is None
                      and self._bulk_write(hidden, r.hidden)):
                put(hidden, r.hidden)
            if target_copy is None:
                put(target, r.target)
            if weight_name:
                r.weight_ref.name = weight_name
                r.weight_ref.version = weight_version
            elif weight is not None:
                if ipc is not None and _is_cuda(weight):
                    weight = weight.contiguous()
                    ipc.place(weight, r.weight)
                else:
                    put(weight, r.weight)
                if bias is not None:
                    put(bias, r.bias)
            pending.inputs = (hidden, weight)
            set_loss_options(r.options, ignore_index=ignore_index, reduction=reduction,
                             label_smoothing=label_smoothing, logit_softcap=logit_softcap,
                             z_loss_scale=z_loss_scale)
            if class_weight is not None:
                put(class_weight, r.options.class_weight)
            r.need_backward = need_backward
            r.backward_mode = _MODES[backward_mode]
            if vocab_shard is not None:
                r.vocab_shard.first, r.vocab_shard.full_vocab = vocab_shard
            r.outputs.lse = want_lse
            r.outputs.per_row_loss = want_per_row_loss
            if backward_into is not None:
                if ipc is None or not need_backward:
                    raise ValueError("backward_into needs cuda_ipc and need_backward")
                for field, tensor in zip(("grad_hidden_out", "grad_weight_out", "grad_bias_out"),
                                         backward_into):
                    if tensor is not None:
                        getattr(r.backward, field).CopyFrom(ipc.slice(tensor))
                if backward_grad_output is not None:
                    to_wire(np.asarray(backward_grad_output, dtype=np.float32),
                            r.backward.grad_output)
            if loss_out is not None:
                if ipc is None:
                    raise ValueError("loss_out needs cuda_ipc")
                r.loss_out.CopyFrom(ipc.slice(loss_out))
            if target_copy is not None:
                to_wire(target_copy.result(), r.target)
            if ipc is not None:
                device = hidden.device if _is_cuda(hidden) else weight.device
                pending.token, r.ready_event = ipc.record_ready(device)
            same_host = shm is not None or ipc is not None
            channel = self.call_channel() if asynchronous and ipc is not None and (
                self._channel_mode is not False) else None
            if channel is not None:
                try:
                    pending.submit(channel, device)
                    return pending
                except (_call_channel.ChannelClosed, ValueError, BlockingIOError):
                    pass  # not made: through gRPC below
            pending.settle(self._unary("Forward", _call_channel.FORWARD, r, pb.ForwardResponse,
                                       same_host=same_host))
        except BaseException:
            pending.fail()
            raise
        return pending if asynchronous else pending.result()

    def _settle_pending(self):
        """Reads the answer of this client's pending Forward, if any (its
        result or error stays with it): the channel is free again."""
        if self._pending is not None:
            self._pending.wait()

    def _forward_result(self, r: "pb.ForwardRequest", resp: "pb.ForwardResponse") -> ForwardResult:
        if resp.session_id:
            h = r.hidden.shape[1]
            v = r.weight.shape[0] if r.HasField("weight") else 0
            self._sessions[resp.session_id] = (r.hidden.shape[0], h, v,
                                               r.HasField("bias"), r.hidden.dtype)
        gradients = None
        if resp.HasField("backward"):
            b = resp.backward
            gradients = Gradients(b.grad_hidden,
                                  b.grad_weight if b.HasField("grad_weight") else None,
                                  b.grad_bias if b.HasField("grad_bias") else None, resp.stats)
        return ForwardResult(resp.loss, resp.z_loss, resp.lse if resp.HasField("lse") else None,
                             resp.num_valid, resp.num_correct, resp.session_id,
                             _MODE_NAMES.get(resp.backward_mode, "auto"), resp.stats, gradients,
                             resp.shard_stats if resp.HasField("shard_stats") else None)

    def backward(self, session_id: str, grad_output=None, *, keep_session: bool = False,
                 float32_grads: bool = False, accumulate_weight_grad: bool = False,
                 shm: Optional[SharedMemoryRegion] = None, into=None,
                 accumulate_into: bool = False, copy_out: bool = True,
                 gradients: str = "all", global_lse=None) -> Gradients:
        """Backward for a session; grad_output is a scalar (mean/sum) or [N]
        (none), None meaning 1. ``gradients``: "all", "hidden" (dX only, the
        session kept for the rest: needs ``keep_session``) or "weight" (dW and
        db only, returned or accumulated; grad_hidden then is None). With
        ``shm``, the gradients come back through that region (the session
        must be this client's, with the weight sent).
        With ``into`` = (dX, dW, db), contiguous CUDA tensors of the
        gradients' dtypes and shapes (None for any to return as bytes), the
        server writes those gradients straight into them (CUDA IPC), after
        the work queued before the call; with ``accumulate_into`` it adds dW
        and db into what those tensors hold (as autograd adds into .grad).
        ``global_lse`` (fp32 [N]): for a vocabulary shard's session, each
        row's log-sum-exp over the whole vocabulary; dX is then the shard's
        part."""
        targets = [t for t in (into or ()) if t is not None]
        if targets and shm is not None:
            raise ValueError("backward: pass shm or into, not both")
        ipc = self.cuda_ipc() if targets else None
        token = None
        try:
            if gradients not in _GRADIENT_SETS:
                raise ValueError(f"gradients={gradients!r}: choose 'all', 'hidden' or 'weight'")
            r = pb.BackwardRequest(session_id=session_id, keep_session=keep_session,
                                   accumulate_weight_grad=accumulate_weight_grad,
                                   gradients=_GRADIENT_SETS[gradients])
            if grad_output is not None:
                to_wire(grad_output, r.grad_output)
            if global_lse is not None:
                to_wire(global_lse, r.global_lse)
            if float32_grads:
                r.grad_dtype = pb.DTYPE_FLOAT32
            shape = self._sessions.get(session_id)
            if not keep_session:
                self._sessions.pop(session_id, None)
            if shm is not None:
                if shape is None or (shape[2] == 0 and not accumulate_weight_grad):
                    raise ValueError("shm: gradients come back through shared memory only for "
                                     "sessions this client made with the weight sent")
                n, h, v, has_bias, dtype = shape
                elem = 4 if float32_grads else _elem_size(dtype)
                align = lambda x: (x + 63) // 64 * 64
                dx, dw = n * h * elem, 0 if accumulate_weight_grad else v * h * elem
                db = v * elem if has_bias and not accumulate_weight_grad else 0
                if align(dx) + align(dw) + db > shm.nbytes:
                    raise ValueError(f"shm: the gradients need {align(dx) + align(dw) + db} "
                                     f"bytes, the region holds {shm.nbytes}")
                for field, offset, size in (("grad_hidden_out", 0, dx),
                                            ("grad_weight_out", align(dx), dw),
                                            ("grad_bias_out", align(dx) + align(dw), db)):
                    if size:
                        getattr(r, field).region_id = shm.region_id
                        getattr(r, field).offset = offset
            if ipc is not None:
                ipc.sweep()
                for field, tensor in zip(("grad_hidden_out", "grad_weight_out", "grad_bias_out"),
                                         into):
                    if tensor is not None:
                        getattr(r, field).CopyFrom(ipc.slice(
                            tensor, accumulate=accumulate_into and field != "grad_hidden_out"))
                token, r.ready_event = ipc.record_ready(targets[0].device)
            resp = self._unary("Backward", _call_channel.BACKWARD, r, pb.BackwardResponse,
                               same_host=shm is not None or ipc is not None)
            if shm is not None and copy_out:
                for t in (resp.grad_hidden, resp.grad_weight, resp.grad_bias):
                    if t.HasField("shm"):
                        nbytes = int(np.prod(t.shape)) * _elem_size(t.dtype)
                        t.data = bytes(shm.buffer[t.shm.offset:t.shm.offset + nbytes])
            return Gradients(resp.grad_hidden if resp.HasField("grad_hidden") else None,
                             resp.grad_weight if resp.HasField("grad_weight") else None,
                             resp.grad_bias if resp.HasField("grad_bias") else None, resp.stats)
        finally:
            if token is not None:
                ipc.done(token)
            if ipc is not None and not ipc.keep:
                ipc.release_allocations()

    def release_session(self, session_id: str) -> bool:
        self._sessions.pop(session_id, None)
        return self._unary("ReleaseSession", _call_channel.RELEASE_SESSION,
                           pb.ReleaseSessionRequest(session_id=session_id),
                           pb.ReleaseSessionResponse, same_host=False).released

    def release_session_later(self, session_id: str):
        """Releases a session without waiting for the answer (safe from a
        finalizer; errors are dropped: the session then expires by its TTL)."""
        self._sessions.pop(session_id, None)
        self._deferred_releases.append(session_id)
        self._flush_releases()

    def release_with_next_forward(self, session_id: str):
        """Releases a session without a call of its own: the next forward()
        carries it (ForwardRequest.release_sessions); past 32 waiting, or at
        close(), ReleaseSession calls go out instead."""
        self._sessions.pop(session_id, None)
        self._deferred_releases.append(session_id)
        if len(self._deferred_releases) > 32:
            self._flush_releases()

    def _flush_releases(self):
        ids, self._deferred_releases = self._deferred_releases, []
        try:
            self._releases = [f for f in self._releases if not f.done()]
            for session_id in ids:
                self._releases.append(self._stub.ReleaseSession.future(
                    pb.ReleaseSessionRequest(session_id=session_id), timeout=self.timeout,
                    metadata=self._metadata))
        except Exception:  # pragma: no cover - e.g. the channel is closed
            pass

    def info(self) -> "pb.GetServerInfoResponse":
        return self._call(self._stub.GetServerInfo, pb.GetServerInfoRequest())

    def stats(self) -> "pb.GetStatsResponse":
        """Request counts, latency histograms and gauges (as /metrics shows)."""
        return self._call(self._stub.GetStats, pb.GetStatsRequest())

    def put_weight(self, name: str, weight, bias=None) -> "pb.WeightInfo":
        """Registers weight [V, H] (and bias [V]) under ``name``, streamed in
        chunks with a checksum (weight_checksum); returns its WeightInfo
        (with the version)."""
        arrays = [_host_bytes(weight)] + ([_host_bytes(bias)] if bias is not None else [])
        (w_dtype, w_shape, _), nbytes = arrays[0], sum(a[2].nbytes for a in arrays)
        bulk = self._bulk_region(nbytes)
        if bulk is not None:
            # Into the region over every connection, each part checked by
            # its CRC-32; the header then names the slice.
            transfer, region = bulk
            offset = 0
            for _, _, data in arrays:
                transfer.write(region, offset, data, self.timeout)
                offset += data.nbytes
            header = pb.WeightHeader(name=name, dtype=w_dtype, shape=w_shape,
                                     has_bias=bias is not None,
                                     source=pb.SharedMemorySlice(region_id=region, offset=0))
            return self._remember(self._put_weight_stream(iter([pb.PutWeightChunk(header=header)])))
        payload = b"".join(a[2].tobytes() for a in arrays)
        header = pb.WeightHeader(name=name, dtype=w_dtype, shape=w_shape,
                                 has_bias=bias is not None, **weight_checksum(payload))
        # Room beside each chunk's data for its framing (and the header).
        step = max(4096, min(self.stream_chunk_bytes, self.max_message_bytes - (16 << 10)))

        def chunks():
            yield pb.PutWeightChunk(header=header, data=payload[:step])
            for offset in range(step, len(payload), step):
                yield pb.PutWeightChunk(data=payload[offset:offset + step])

        return self._remember(self._put_weight_stream(chunks()))

    def _remember(self, info: "pb.WeightInfo") -> "pb.WeightInfo":
        """Keeps a put weight's sizes (for its gradient's bulk transfer)."""
        self._weights[info.name] = (info.shape[0], info.shape[1], info.has_bias, info.dtype)
        return info

    def _put_weight_stream(self, chunks) -> "pb.WeightInfo":
        call = self._stub.PutWeight.future(chunks, timeout=self.timeout,
                                           metadata=self._metadata)
        return future_result(call, self.timeout, "PutWeight").weight

    def delete_weight(self, name: str) -> bool:
        return self._call(self._stub.DeleteWeight, pb.DeleteWeightRequest(name=name)).deleted

    def list_weights(self) -> Sequence["pb.WeightInfo"]:
        return list(self._call(self._stub.ListWeights, pb.ListWeightsRequest()).weights)

    def take_weight_grad(self, name: str, version: int = 0, float32: bool = True, out=None):
        """The gradient accumulated into a weight (and resets it): returns
        (grad_weight, grad_bias or None, accumulated_backwards) as wire
        Tensors; with ``out`` = (w, b or None), writable contiguous CPU
        buffers (torch tensors or NumPy arrays) of the gradient's shapes and
        dtype, it lands in them and they are returned instead.
        ``float32=False`` asks for the weight's dtype where this client knows
        it (it put the weight; rounded once from the fp32 sum on the server),
        else fp32. The server keeps each take until the next one of the
        version: if this one does not arrive whole, this client's next take
        gets it again. A large one comes over several connections (see
        :meth:`bulk`) when this client knows the weight's size."""
        r = pb.TakeWeightGradRequest(dtype=pb.DTYPE_FLOAT32 if float32 else pb.DTYPE_UNSPECIFIED,
                                     hold_until_acknowledged=True,
                                     resume_take=self._lost_takes.get(name, 0))
        r.weight.name = name
        r.weight.version = version
        known = self._weights.get(name)
        nbytes = 0
        if known is not None:
            v, h, has_bias, dtype = known
            if not float32:
                r.dtype = dtype  # narrowed on the server: half the bytes for bf16
            elem = 4 if float32 else _elem_size(dtype)
            nbytes = (v * h + (v if has_bias else 0)) * elem
            if out is not None:  # checked before anything is taken
                _writable_bytes(out[0], v * h * elem, "out[0]")
                if has_bias:
                    _writable_bytes(out[1], v * elem, "out[1]")
        bulk = self._bulk_region(nbytes) if nbytes else None
        if bulk is not None:
            r.into.region_id = bulk[1]
        header = None
        parts = []
        try:
            for chunk in self._stub.TakeWeightGrad(r, timeout=self.timeout,
                                                   metadata=self._metadata):
                if chunk.HasField("header"):
                    header = chunk.header
                parts.append(chunk.data)
        except grpc.RpcError as e:
            if header is not None and header.take_id:
                self._lost_takes[name] = header.take_id  # asked for again next time
            raise FlceError(e.code(), e.details()) from None
        v, h = header.weight.shape
        elem = _elem_size(header.dtype)
        w_bytes, b_bytes = v * h * elem, (v * elem if header.weight.has_bias else 0)
        if out is None:
            data = bytearray(w_bytes + b_bytes) if bulk is not None else b"".join(parts)
            views = [memoryview(data)[:w_bytes], memoryview(data)[w_bytes:]]
        else:
            try:
                views = [_writable_bytes(out[0], w_bytes, "out[0]"),
                         _writable_bytes(out[1], b_bytes, "out[1]") if b_bytes else None]
            except ValueError:
                self._lost_takes[name] = header.take_id  # not lost: the next take has it
                raise
        if bulk is not None:
            transfer, region = bulk
            try:
                transfer.read(region, 0, views[0], self.timeout)
                if b_bytes:
                    transfer.read(region, w_bytes, views[1], self.timeout)
            except FlceError:
                self._lost_takes[name] = header.take_id  # asked for again next time
                raise
        elif out is not None:
            data = b"".join(parts)
            views[0][:] = data[:w_bytes]
            if b_bytes:
                views[1][:] = data[w_bytes:]
        self._lost_takes.pop(name, None)
        if out is not None:
            return out[0], (out[1] if b_bytes else None), header.accumulated_backwards
        dw = pb.Tensor(dtype=header.dtype, shape=[v, h], data=bytes(views[0]))
        db = pb.Tensor(dtype=header.dtype, shape=[v], data=bytes(views[1])) if b_bytes else None
        return dw, db, header.accumulated_backwards
