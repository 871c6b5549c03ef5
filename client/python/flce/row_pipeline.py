"""A remote training step in row pieces, so that the wire and the server's GPU work at once.

Over the network a step moves X up and dX back: at a few GB/s, tens of
milliseconds each for a large batch, as long as the engine's own work. Here
the batch's rows go in pieces (``pieces``, each at least
``min_piece_bytes`` of X; one piece for a batch with less). Each piece is
written into a region of the server's memory over all of the client's bulk
connections (:mod:`flce.bulk`); its Forward starts as soon as it has
arrived, while the next piece travels,
and in the same call (its eager backward, ``GRADIENTS_HIDDEN``) writes the
piece's dX into the region for the upstream gradient the last step had,
before the server starts the next piece; the client reads it back while the
server works on the following pieces (the read sent before the answer where
the server holds it until dX is written: marks, :meth:`flce.bulk.BulkTransfer.read_marked`).
When autograd's backward comes with that same upstream
gradient, one small Backward per piece (``gradients="weight"``) adds dW and
db into the registered weight's sum on the server — sent behind the next
step's Forwards (or after 50 ms with no step under way), waited for by the
weight's next pull — and dX is already here: a step is the
engine's time plus one piece's transfer each way. Another
upstream gradient (the first step of a run with gradient accumulation, say)
gets the exact gradients the slow way: each piece's full Backward, dX read
again.

Each piece is a Forward of its own with reduction "sum"; for "mean" the
client divides by the whole batch's normaliser (its non-ignored rows, or
the sum of their class weights), computed from the targets here, and scales
the pieces' gradients by it: the loss and gradients equal one call's up to
fp32 rounding. Used by :class:`flce.RemoteLinearCrossEntropy` for a
registered weight over the network (``pipeline_pieces``); reduction "none",
``retain_graph`` and a batch whose rows are all ignored take one call.
"""

import concurrent.futures
import threading
import time
from typing import List, Optional

import grpc
import numpy as np
import torch

from flce import bulk_http
from flce.client import _MODES, FlceError, future_result, set_loss_options, to_torch, to_wire
from flce.client import wire_scalar
from flce.wire_dtypes import TORCH_TO_WIRE
from flce_pb.v1 import loss_service_pb2 as pb


def _align(n: int) -> int:
    return (n + 4095) // 4096 * 4096


def _byte_view(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor, as a NumPy array (no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy()


class _Buffers:
    """Host memory for X's and dX's bytes (pinned when the tensors are on
    the GPU), kept and grown across steps."""

    def __init__(self):
        self._x = self._dx = None

    def get(self, nbytes: int, pinned: bool):
        if self._x is None or self._x.numel() < nbytes or self._x.is_pinned() != pinned:
            self._x = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
            self._dx = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        return self._x[:nbytes], self._dx[:nbytes]


class PipelinedStep:
    """One step's pieces after the forward: the loss, dX (already here, for
    the expected upstream gradient) and the pieces' sessions, which
    :meth:`finish` or the garbage collector releases."""

    def __init__(self, pipeline, sessions, rows, denom, expected, dx, loss, z_loss, num_valid,
                 stats, dx_ready):
        self._pipeline = pipeline
        self.sessions = sessions        # one per piece
        self.rows = rows                # (first, last) row of each piece
        self.denom = denom              # the batch's normaliser (None: reduction sum)
        self.expected = expected        # the upstream gradient dX was made for
        self.dx = dx
        self.loss = loss
        self.z_loss = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[],
                                data=np.float32(z_loss).tobytes())
        self.num_valid = num_valid
        self.stats = stats              # summed over the pieces' calls
        self._dx_ready = dx_ready       # CUDA events of the dX copies (or [])
        self.consumed = False

    def piece_grad(self, grad_output: float) -> np.float32:
        """Each piece's grad_output (its Forward summed) for the step's
        upstream gradient."""
        return _piece_grad(grad_output, self.denom)

    def finish(self, grad_output: float, registration) -> torch.Tensor:
        """Adds dW (db) into the registered weight's sum for ``grad_output``
        and returns dX for it. For the expected upstream gradient the adds
        are deferred with ``registration`` (sent behind the next step's
        calls; its next pull, weight change or close sends and waits for
        them): dX is here already."""
        self.consumed = True
        # The pieces' copies into dX first: the exact path overwrites it.
        for event in self._dx_ready:
            torch.cuda.current_stream(self.dx.device).wait_event(event)
        return self._pipeline.finish(self, grad_output, registration)

    def __del__(self):
        if not self.consumed:
            try:
                for session_id in self.sessions:
                    self._pipeline.client.release_session_later(session_id)
            except Exception:  # pragma: no cover - interpreter shutdown
                pass


class RowPipeline:
    """The row pieces of a remote module's steps (see the module's doc)."""

    def __init__(self, client, pieces: int = 4, min_piece_bytes: int = 4 << 20):
        self.client = client
        self.pieces = pieces
        self.min_piece_bytes = min_piece_bytes
        self._buffers = _Buffers()
        self._stream = None  # a side stream for the pieces' host ↔ GPU copies
        self._pool = None  # the pieces' threads, kept across steps
        self._pool_size = 0
        # The last forward's moments (time.monotonic(), by name: "start",
        # "staged i", "written i", "answered i", "read i", "end"), for
        # benchmarks' timelines.
        self.last_stamps = {}

    def plan(self, hidden, reduction: str) -> int:
        """How many pieces a step of ``hidden`` takes (0: not through here,
        X in the messages of one call). X that the client moves over its
        bulk connections (at least its ``bulk_threshold``) comes through
        here: in pieces of at least ``min_piece_bytes``, or in one piece
        when it has fewer bytes than two of them (still through the bulk
        port: 3–4× faster than in a message for 8–16 MiB of X on the
        development VM; bench/RESULTS.md)."""
        nbytes = hidden.numel() * hidden.element_size()
        if reduction == "none" or self.client.bulk(nbytes) is None:
            return 0
        return max(1, min(self.pieces, hidden.shape[0], nbytes // max(1, self.min_piece_bytes)))

    def forward(self, module, hidden, target, weight_name: str, weight_version: int,
                expected: float, pieces: int) -> Optional[PipelinedStep]:
        """The forward of one step in ``pieces`` pieces, with dX for the
        upstream gradient ``expected``; None where the batch has nothing to
        normalise by (all rows ignored): the caller takes one call."""
        client = self.client
        stamps = self.last_stamps = {"start": time.monotonic()}
        client.hold_channel_thread()
        n, h = hidden.shape
        elem = hidden.element_size()
        targets = target.detach().to("cpu")
        valid = targets.numpy() != module.ignore_index
        if module.reduction == "mean":
            if module.class_weight is not None:
                cw = np.asarray(torch.as_tensor(module.class_weight).detach().cpu().double())
                t = targets.numpy()[valid]
                # (A target out of range fails its piece on the server, by name.)
                t = t[(t >= 0) & (t < len(cw))]
                denom = float(np.sum(cw[t], dtype=np.float64))
            else:
                denom = float(np.count_nonzero(valid))
            if denom == 0.0:
                return None
        else:
            denom = None
        bounds = np.linspace(0, n, pieces + 1).astype(int)
        rows = [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
        x_bytes = n * h * elem
        transfer = client.bulk(x_bytes)
        if transfer is None:
            raise FlceError(grpc.StatusCode.UNAVAILABLE, "no bulk transfer")
        region = transfer.region(2 * _align(x_bytes))
        dx_at = _align(x_bytes)
        on_gpu = hidden.is_cuda
        x_host, dx_host = self._buffers.get(x_bytes, pinned=on_gpu)
        flat = hidden.detach().contiguous().reshape(-1).view(torch.uint8)
        # Each piece comes off the GPU range by range (the ranges its write
        # goes in), each range's upload starting once its copy is done.
        staged = []  # per piece: (its range, the copy's event)
        if on_gpu:
            if self._stream is None:
                self._stream = torch.cuda.Stream(hidden.device)
            self._stream.wait_stream(torch.cuda.current_stream(hidden.device))
            with torch.cuda.stream(self._stream):
                for first, last in rows:
                    base = first * h * elem
                    copies = []
                    for span in transfer.spans((last - first) * h * elem):
                        x_host[base + span.start:base + span.stop].copy_(
                            flat[base + span.start:base + span.stop], non_blocking=True)
                        event = torch.cuda.Event()
                        event.record()
                        copies.append((span, event))
                    staged.append(copies)
            flat.record_stream(self._stream)
        else:
            x_host = flat
        # The pieces' requests while X comes off the GPU. Where the server's
        # bulk reads wait for marks, each piece's Forward posts one once its
        # dX is in the region, and the read of that dX goes out before the
        # answer (it waits at the server): one round trip less a piece.
        marked = transfer.marks and transfer.over_http
        requests = self._requests(module, hidden, weight_name, weight_version, targets, rows,
                                  expected, denom, region, dx_at,
                                  [transfer.next_mark() if marked else 0 for _ in rows])

        dx = torch.empty_like(hidden, memory_format=torch.contiguous_format)
        dx_flat = dx.reshape(-1).view(torch.uint8)
        x_view = _byte_view(x_host)
        # On the CPU dX is read straight into the result.
        dx_view = _byte_view(dx_host if on_gpu else dx_flat)
        sessions: List[str] = [""] * len(rows)
        lock = threading.Lock()
        dx_ready = []
        written = [threading.Event() for _ in rows]
        cancels = [bulk_http.Cancel() for _ in rows]

        def chain(i: int, call):
            """Piece i after its Forward went out: dX read back (as soon as
            the server has written it, where marked; else after the answer),
            each range onto the GPU as soon as it is here; the answer."""
            first, last = rows[i]
            span = slice(first * h * elem, last * h * elem)

            def landed(part: range):  # a range of the piece's dX is here
                at = slice(span.start + part.start, span.start + part.stop)
                with torch.cuda.stream(self._stream):
                    dx_flat[at].copy_(dx_host[at], non_blocking=True)
                    event = torch.cuda.Event()
                    event.record()
                with lock:
                    dx_ready.append(event)

            landed = landed if on_gpu else None
            read = False
            if marked:
                # Once the next piece is up: this process's read beside its
                # own write slows both (bench/RESULTS.md, 2026-12-05).
                if i + 1 < len(rows):
                    written[i + 1].wait()
                try:
                    read = transfer.read_marked(region, dx_at + span.start, dx_view[span],
                                                requests[i].backward.written_mark,
                                                client.timeout, cancels[i], landed)
                except FlceError:
                    # The Forward's failure says more than the read's.
                    sessions[i] = future_result(call, client.timeout, "Forward").session_id
                    raise
            resp = future_result(call, client.timeout, "Forward")
            stamps[f"answered {i}"] = time.monotonic()
            sessions[i] = resp.session_id
            if not read:
                transfer.read(region, dx_at + span.start, dx_view[span], client.timeout, landed)
            stamps[f"read {i}"] = time.monotonic()
            return resp

        pool = self._threads(len(rows))
        futures = []
        try:
            for i, (first, last) in enumerate(rows):
                span = slice(first * h * elem, last * h * elem)
                before = None
                if staged:
                    staged[i][0][1].synchronize()

                    def before(part: range, copies=staged[i]):
                        for done, event in copies:
                            if done.start < part.stop and part.start < done.stop:
                                event.synchronize()
                stamps[f"staged {i}"] = time.monotonic()  # (its first range)
                transfer.write(region, span.start, x_view[span], client.timeout, before)
                stamps[f"written {i}"] = time.monotonic()
                written[i].set()
                call = client._stub.Forward.future(requests[i], timeout=client.timeout,
                                                   metadata=client._metadata)
                # A Forward that fails before it reaches the server posts no
                # mark: its read ends here.
                call.add_done_callback(
                    lambda c, cancel=cancels[i]: c.code() != grpc.StatusCode.OK
                    and cancel.cancel())
                futures.append(pool.submit(chain, i, call))
                if i == len(rows) - 1 and module._registration is not None:
                    # The last step's adds, behind this step's Forwards.
                    module._registration.send_deferred()
            answers = [f.result() for f in futures]
        except BaseException:
            for event, cancel in zip(written, cancels):
                event.set()
                cancel.cancel()
            for f in futures:
                f.cancel()
            concurrent.futures.wait(futures)
            for session_id in sessions:
                if session_id:
                    client.release_session_later(session_id)
            raise
        if on_gpu:
            dx.record_stream(self._stream)
        stamps["end"] = time.monotonic()
        loss = sum(wire_scalar(f.loss) for f in answers)
        z_loss = sum(wire_scalar(f.z_loss) for f in answers)
        if denom is not None:
            loss, z_loss = loss / denom, z_loss / denom
        stats = pb.CallStats(queue_ms=sum(f.stats.queue_ms for f in answers),
                             engine_ms=sum(f.stats.engine_ms for f in answers))
        return PipelinedStep(self, sessions, rows, denom, expected, dx, np.float32(loss), z_loss,
                             sum(f.num_valid for f in answers), stats, dx_ready)

    def _threads(self, n: int) -> concurrent.futures.ThreadPoolExecutor:
        """A thread for each of ``n`` pieces, kept across steps."""
        if self._pool_size < n:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=n,
                                                               thread_name_prefix="flce-rows")
            self._pool_size = n
        return self._pool

    @staticmethod
    def _requests(module, hidden, weight_name: str, weight_version: int, targets, rows,
                  expected: float, denom, region: str, dx_at: int, marks) -> list:
        """Each piece's Forward: its rows of X from the region, its dX for
        ``expected`` written into it at ``dx_at`` onwards in the same call
        (posting its mark of ``marks`` then, where not 0); dW and db stay in
        the session (finish adds them into the registered sum)."""
        h, elem = hidden.shape[1], hidden.element_size()
        base = pb.ForwardRequest(need_backward=True, backward_mode=_MODES[module.backward_mode])
        base.weight_ref.name = weight_name
        base.weight_ref.version = weight_version
        set_loss_options(base.options, ignore_index=module.ignore_index, reduction="sum",
                         label_smoothing=module.label_smoothing,
                         logit_softcap=module.logit_softcap, z_loss_scale=module.z_loss_scale)
        if module.class_weight is not None:
            to_wire(module.class_weight, base.options.class_weight)
        base.hidden.dtype = TORCH_TO_WIRE[str(hidden.dtype)]
        base.hidden.shm.region_id = region
        base.backward.gradients = pb.GRADIENTS_HIDDEN
        to_wire(np.asarray(_piece_grad(expected, denom), dtype=np.float32),
                base.backward.grad_output)
        base.backward.grad_hidden_out.region_id = region
        requests = []
        for (first, last), mark in zip(rows, marks):
            r = pb.ForwardRequest()
            r.CopyFrom(base)
            r.hidden.shape.extend([last - first, h])
            r.hidden.shm.offset = first * h * elem
            r.backward.grad_hidden_out.offset = dx_at + first * h * elem
            r.backward.written_mark = mark
            to_wire(targets[first:last], r.target)
            requests.append(r)
        return requests

    def finish(self, step: PipelinedStep, grad_output: float, registration) -> torch.Tensor:
        """Backward of a step's pieces (see PipelinedStep.finish)."""
        client = self.client
        same = grad_output == step.expected
        g = step.piece_grad(grad_output)

        def issue():
            calls = []
            for session_id in step.sessions:
                r = pb.BackwardRequest(session_id=session_id, accumulate_weight_grad=True,
                                       gradients=pb.GRADIENTS_WEIGHT if same
                                       else pb.GRADIENTS_ALL)
                to_wire(np.asarray(g, dtype=np.float32), r.grad_output)
                calls.append(client._stub.Backward.future(r, timeout=client.timeout,
                                                          metadata=client._metadata))
            return calls

        def settle(calls):
            answers, failed = [], None
            for call in calls:
                try:
                    answers.append(future_result(call, client.timeout, "Backward"))
                except FlceError as e:
                    failed = failed or e
            if failed is not None:
                raise failed
            step.stats.engine_ms += sum(a.stats.engine_ms for a in answers)
            step.stats.queue_ms += sum(a.stats.queue_ms for a in answers)
            return answers

        if same:
            # Sent once the next step's pieces are out (or before the sum is
            # read): not on autograd's path now, and on the server they run
            # while that step's last dX crosses the wire.
            registration.defer(issue, settle)
            return step.dx
        registration.send_deferred()  # the sum's adds in the steps' order
        answers = settle(issue())
        # Another upstream gradient: dX as the full Backwards returned it.
        for answer, (first, last) in zip(answers, step.rows):
            step.dx[first:last].copy_(to_torch(answer.grad_hidden, step.dx.device))
        return step.dx


def _piece_grad(grad_output: float, denom: Optional[float]) -> np.float32:
    """A piece's grad_output: the step's upstream gradient over the batch's
    normaliser (reduction mean; None: sum), in fp32."""
    return np.float32(grad_output if denom is None else grad_output / denom)

