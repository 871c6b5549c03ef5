"""What a training worker waits for: one loss step through flce, beside local PyTorch.

In one process, on the same data, for each shape: the worker-visible wall
time of forward + backward of ``RemoteLinearCrossEntropy`` for each
transport, the server's engine time for the same calls (Forward's and
Backward's ``CallStats.engine_ms``, from the responses), and local PyTorch
eager ``F.cross_entropy(F.linear(x, w).float(), t)`` forward + backward;
plus the worker's extra memory (peak during the step beyond its inputs and
its own gradients). Median of ``--iters`` steps after ``--warmup``. Starts
its own flce_server (``--backend`` cuda or cpu, shared memory on).
``--gpu_busy_ms`` queues that much GPU work at each step's start (inside
its time, left out of the overhead): the loss called while the model's
forward still runs, as in a training loop, where a call that waits for
the GPU before its request goes out (CUDA targets copied to the host)
shows it.

Transports: ``cuda_ipc`` (GPU tensors read and written in place, the calls
through a call channel), ``cuda_ipc_grpc`` (the same with the calls through
gRPC), ``inline`` (bytes in the messages, W with every call),
``registered`` (the network path's default: W registered, only X, t and dX
per call, in row pieces over the bulk connections, dW summed on the server
and pulled once, timed apart), ``registered_one_call`` (the same in one
Forward and one Backward, X and dX in the messages), ``shm`` (CPU tensors through a POSIX
shared-memory region, the calls through a call channel), ``shm_grpc`` (the
same through gRPC). GPU tensors need ``--device=cuda``; ``shm`` takes CPU
tensors. ``registered:K`` is ``registered`` in K row pieces (``--pieces``
otherwise), so that piece counts compare in one run.

Usage: worker_bench.py FLCE_SERVER [--backend cuda] [--device cuda]
  [--shapes NxHxV,...] [--transports cuda_ipc,inline] [--dtype bf16]
  [--iters 10] [--warmup 3] [--json PATH] [--breakdown] [--phases] [--timeline]
  [--profile K] [--channel_wakes] [--server_flags "..."] [--pieces 4] [--gpu_busy_ms 0]
  [--host_targets] [--no_gpu_fence]
Needs PyTorch, the flce package and server_process.py on PYTHONPATH.
"""

import argparse
import json
import re
import statistics
import struct
import sys
import time

import torch
import torch.nn.functional as F

import flce
from server_process import ServerProcess

DEFAULT_SHAPES = ("512x256x32000,4096x4096x32000,4096x4096x128256,8192x4096x128256,"
                  "8192x2304x256000")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory(device):
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def reset_peak(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak(device):
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


class GpuBusy:
    """Queues about ``ms`` (> 0) of GPU work on the current stream (a
    spinning kernel): what a model's forward leaves queued when its loss is
    called. Calibrated once against CUDA events."""

    def __init__(self, ms: float):
        probe = 10_000_000
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(probe)  # warm
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
        self.cycles = int(probe * ms / start.elapsed_time(end))

    def __call__(self):
        torch.cuda._sleep(self.cycles)


def time_steps(step, hidden, weight, target, warmup, iters, busy=None):
    """Worker-visible ms of each timed step, and the extra bytes beyond the
    inputs and the step's own gradients (dX, dW) at its peak. ``busy``
    (a GpuBusy) queues GPU work at each step's start, inside its time."""
    device = hidden.device
    times, extra, stats = [], 0, []
    for i in range(warmup + iters):
        h = hidden.detach().requires_grad_()
        w = weight.detach().requires_grad_()
        sync(device)
        reset_peak(device)
        base = memory(device)
        start = time.perf_counter()
        if busy is not None:
            busy()
        step_stats = step(h, w, target)
        sync(device)
        elapsed = (time.perf_counter() - start) * 1e3
        if i >= warmup:
            times.append(elapsed)
            if step_stats is not None:
                stats.append(step_stats)
            own = sum(g.numel() * g.element_size() for g in (h.grad, w.grad)
                      if g is not None and g.device.type == device.type)
            extra = max(extra, peak(device) - base - own)
        del h, w
    return times, extra, stats


def eager_step(h, w, t):
    F.cross_entropy(F.linear(h, w).float(), t).backward()
    return None


def flce_step(module):
    """A step that returns where its time went (ms): the module's forward
    and backward as the worker sees them, their RPCs' wall time, and the
    server's queue and engine time of each. A registered weight's dW stays
    summed on the server (gradient accumulation: pulled once per optimizer
    step, timed apart)."""
    client = module.client

    def step(h, w, t):
        start = time.perf_counter()
        loss = module(h, w, t)
        forward_ms = (time.perf_counter() - start) * 1e3
        forward_rpc = client.last_call_ms
        start = time.perf_counter()
        loss.backward()
        backward_rpc = client.last_call_ms
        backward_ms = (time.perf_counter() - start) * 1e3
        # Read once the step's calls are all answered (a registered weight's
        # adds into its sum may still be in flight, their times still to
        # come into these stats): after the steps.
        stats = module.last_stats
        return lambda: breakdown(stats, forward_ms, forward_rpc, backward_ms, backward_rpc)

    def breakdown(stats, forward_ms, forward_rpc, backward_ms, backward_rpc):
        fwd, bwd = stats  # bwd None: the gradients came with Forward
        return {"engine": fwd.engine_ms + (bwd.engine_ms if bwd else 0.0),
                "forward": forward_ms, "forward_rpc": forward_rpc,
                "forward_queue": fwd.queue_ms, "forward_engine": fwd.engine_ms,
                "backward": backward_ms, "backward_rpc": backward_rpc if bwd else 0.0,
                "backward_queue": bwd.queue_ms if bwd else 0.0,
                "backward_engine": bwd.engine_ms if bwd else 0.0}
    return step


def time_pull(module, hidden, weight, target):
    """ms of pulling a registered weight's summed dW (and db) into .grad
    after one more step, as before an optimizer step; None without one."""
    if module._registration is None:
        return None
    module.pull_weight_grads()
    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()
    module(h, w, target).backward()
    sync(hidden.device)
    start = time.perf_counter()
    module.pull_weight_grads()
    sync(hidden.device)
    return (time.perf_counter() - start) * 1e3


def wrap_in_place(module, attribute, wrap):
    """Replaces `module`'s `attribute` ("Class.method" or "function") with
    wrap(original, is_staticmethod), for this process."""
    import importlib

    holder = importlib.import_module(module)
    *path, name = attribute.split(".")
    for part in path:
        holder = getattr(holder, part)
    static = isinstance(vars(holder).get(name), staticmethod)
    setattr(holder, name, wrap(getattr(holder, name), static))


class ChannelWakes:
    """How many of the timed steps' calls through a call channel found the
    server's channel thread asleep (its kServerWaiting word set as the
    call was made: a wake-up on both sides) rather than polling, by method
    (wraps CallChannel.submit in place; counts while enabled, as a
    profiler: see `profiled`)."""

    NAMES = {1: "Forward", 2: "Backward", 3: "ReleaseSession"}
    # proto/call_channel_layout.h's kServerWaitingOffset, read from the
    # region itself so that any version of the client can be counted.
    SERVER_WAITING = 256

    def __init__(self):
        self.counting = False
        self.counts = {}  # method name → [asleep, calls]
        wrap_in_place("flce.call_channel", "CallChannel.submit",
                      lambda f, static: self._counted(f))

    def enable(self):
        self.counting = True

    def disable(self):
        self.counting = False

    def _counted(self, submit):
        wakes = self

        def counted(channel, method, *args, **kwargs):
            if wakes.counting:
                count = wakes.counts.setdefault(wakes.NAMES.get(method, str(method)), [0, 0])
                count[0] += struct.unpack_from("<I", channel._region.buffer,
                                               wakes.SERVER_WAITING)[0] != 0
                count[1] += 1
            return submit(channel, method, *args, **kwargs)
        return counted

    def print(self, shape, transport):
        parts = [f"{name} {asleep} of {calls}" for name, (asleep, calls) in self.counts.items()]
        print(f"  {shape} {transport} calls that found the channel's thread asleep: "
              + (", ".join(parts) or "no channel calls"), flush=True)
        self.counts = {}


class Phases:
    """Wall time per step spent in named functions of the worker's path
    (wrapped in place for the benchmark's process; nested calls count in
    each of their callers)."""

    TARGETS = (  # (module, attribute)
        ("torch", "empty"), ("torch", "full"), ("torch", "Tensor.cpu"), ("torch", "Tensor.to"),
        ("flce.client", "to_wire"), ("flce.client", "Client._call"),
        ("flce.client", "Client.forward"), ("flce.call_channel", "CallChannel.call"),
        ("flce.call_channel", "CallChannel.submit"), ("flce.call_channel", "CallChannel.accepted"),
        ("flce.call_channel", "CallChannel.finish"), ("flce.client", "PendingForward.wait"),
        ("flce.cuda_ipc", "CudaIpcRegistry.wait_fence"), ("flce.client", "Client._settle_pending"),
        ("flce.cuda_ipc", "CudaIpcRegistry.sweep"), ("flce.cuda_ipc", "CudaIpcRegistry.slice"),
        ("flce.cuda_ipc", "CudaIpcRegistry.record_ready"),
        ("flce.torch_loss", "_RemoteFunction.backward"),
    )

    def __init__(self):
        self.step = {}
        self.steps = []
        for module, attribute in self.TARGETS:
            wrap_in_place(module, attribute, lambda f, static, label=attribute:
                          self._timed(f, label, static))

    def _timed(self, original, label, static):
        phases = self

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                phases.step[label] = phases.step.get(label, 0.0) + (
                    time.perf_counter() - start) * 1e3
        return staticmethod(timed) if static else timed

    def wrap(self, step):
        def run(h, w, t):
            self.step = {}
            try:
                return step(h, w, t)
            finally:
                self.steps.append(self.step)
        return run

    def print(self, shape, transport, skip):
        steps = self.steps[skip:]
        labels = sorted({k for s in steps for k in s})
        parts = [f"{k} {statistics.median(s.get(k, 0.0) for s in steps):.3f}" for k in labels]
        print(f"  {shape} {transport} phases (ms per step, medians): " + ", ".join(parts),
              flush=True)
        self.steps = []


class Timeline:
    """When, within each step, the worker and the server reached each point
    of the call, on the host's one monotonic clock (same host): the
    worker's functions entered and left (wrapped in place, the first call
    of each per step), its stream's progress (CUDA events recorded after
    the forward and after the backward, placed on the host's clock from an
    event recorded at the step's start), and the server's stamps of its
    Forward and Backward (its DEBUG timeline lines). Medians over the steps,
    ms from the step's start."""

    TARGETS = (  # (module, attribute, short name)
        ("flce.client", "Client.forward", "client.forward"),
        ("flce.call_channel", "CallChannel.submit", "channel.submit"),
        ("flce.call_channel", "CallChannel.accepted", "channel.accepted"),
        ("flce.cuda_ipc", "CudaIpcRegistry.wait_fence", "wait_fence"),
        ("flce.call_channel", "CallChannel.finish", "channel.finish"),
        ("flce.torch_loss", "_RemoteFunction.backward", "function.backward"),
        ("flce.row_pipeline", "PipelinedStep.finish", "pieces.finish"),
        ("flce.torch_loss", "RemoteLinearCrossEntropy.forward", "module.forward"),
        ("torch", "Tensor.backward", "loss.backward"),
        ("torch", "Tensor.cpu", "tensor.cpu"),
        ("torch", "full", "torch.full"),
    )

    def __init__(self):
        self.step = None
        self.steps = []
        self.module = None  # the module timed now (its row pieces' moments)
        for module, attribute, name in self.TARGETS:
            wrap_in_place(module, attribute, lambda f, static, label=name:
                          self._timed(f, label, static))

    def _timed(self, original, name, static):
        timeline = self

        def timed(*args, **kwargs):
            step = timeline.step
            if step is None or name + " in" in step:
                return original(*args, **kwargs)
            step[name + " in"] = time.monotonic()
            try:
                return original(*args, **kwargs)
            finally:
                step[name + " out"] = time.monotonic()
                if name in ("module.forward", "loss.backward") and "gpu start" in step:
                    event = torch.cuda.Event(enable_timing=True)
                    event.record()
                    step["gpu after " + name] = event
        return staticmethod(timed) if static else timed

    def wrap(self, step):
        def run(h, w, t):
            self.step = {}
            if h.is_cuda:
                self.step["gpu start"] = torch.cuda.Event(enable_timing=True)
                self.step["gpu start"].record()
            self.step["start"] = time.monotonic()
            try:
                return step(h, w, t)
            finally:
                self.step["end"] = time.monotonic()
                # A registered module's row pieces: their moments too.
                pipeline = getattr(self.module, "_pipeline", None)
                for key, at in (getattr(pipeline, "last_stamps", None) or {}).items():
                    self.step["pieces " + key] = at
                self.steps.append(self.step)
                self.step = None
        return run

    def print(self, shape, transport, skip, server):
        """Prints the medians; `server`'s log gives its stamps."""
        if any("gpu start" in step for step in self.steps):
            torch.cuda.synchronize()
        lines = re.findall(r"rpc=(\w+) timeline start_mono_us=(\d+)((?: \w+=\+\d+)*)",
                           server.read_log())
        calls = []
        for rpc, start_us, marks in lines:
            start = int(start_us) / 1e6
            stamps = {"start": start}
            for stage, offset in re.findall(r"(\w+)=\+(\d+)", marks):
                stamps[stage] = start + int(offset) / 1e6
            calls.append((rpc, start, stamps))
        points = {}
        for step in self.steps[skip:]:
            t0 = step["start"]
            for key, value in step.items():
                if key == "start" or key == "gpu start":
                    continue
                if isinstance(value, torch.cuda.Event):
                    value = t0 + step["gpu start"].elapsed_time(value) / 1e3
                points.setdefault("worker " + key, []).append((value - t0) * 1e3)
            seen = {}  # calls of each rpc in this step so far
            for rpc, start, stamps in calls:
                if t0 <= start <= step["end"]:
                    k = seen[rpc] = seen.get(rpc, 0) + 1
                    label = f"{rpc}#{k}" if k > 1 else rpc
                    for stage, at in stamps.items():
                        points.setdefault(f"server {label} {stage}", []).append((at - t0) * 1e3)
        rows = sorted((statistics.median(v), k) for k, v in points.items())
        print(f"  {shape} {transport} timeline (ms from the step's start, medians of "
              f"{len(self.steps) - skip} steps):", flush=True)
        for at, key in rows:
            print(f"    {at:8.3f}  {key}", flush=True)
        self.steps = []


def profiled(step, profiler, skip):
    """`step` with `profiler` on for each call after the first `skip`."""
    calls = [0]

    def run(h, w, t):
        calls[0] += 1
        if calls[0] <= skip:
            return step(h, w, t)
        profiler.enable()
        try:
            return step(h, w, t)
        finally:
            profiler.disable()
    return run


def server_ms(server, rpc, count):
    """The server's own time (receipt to answer, its access log) of the last
    `count` calls of `rpc`."""
    found = re.findall(rf"rpc={rpc} .*? ms=([0-9.]+)", server.read_log())
    return [float(x) for x in found[-count:]]


def print_breakdown(shape, transport, times, stats, server):
    """Medians of where a step's time went."""
    med = lambda key: statistics.median(s[key] for s in stats)
    fwd_server = statistics.median(server_ms(server, "Forward", len(stats)))
    bwd_calls = server_ms(server, "Backward", len(stats))
    bwd_server = statistics.median(bwd_calls) if med("backward_rpc") > 0 and bwd_calls else 0.0
    print(f"  {shape} {transport} breakdown (ms, medians): step {statistics.median(times):.2f} = "
          f"forward {med('forward'):.2f} [rpc {med('forward_rpc'):.2f}: server "
          f"{fwd_server:.1f} (queue {med('forward_queue'):.2f}, engine "
          f"{med('forward_engine'):.2f})] + backward {med('backward'):.2f} [rpc "
          f"{med('backward_rpc'):.2f}: server {bwd_server:.1f} (queue "
          f"{med('backward_queue'):.2f}, engine {med('backward_engine'):.2f})] + the rest",
          flush=True)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("server_binary")
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES)
    parser.add_argument("--transports", default="cuda_ipc")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", default="")
    parser.add_argument("--server_flags", default="",
                        help="more flce_server flags, space-separated (e.g. an engine option "
                             "to compare against)")
    parser.add_argument("--pieces", type=int, default=4,
                        help="row pieces of the registered transport (pipeline_pieces)")
    parser.add_argument("--min_piece_mib", type=float, default=16,
                        help="the registered transport's smallest piece of X, MiB "
                             "(pipeline_min_piece_bytes)")
    parser.add_argument("--bulk_connections", type=int, default=8,
                        help="the client's bulk connections (Client(bulk_connections=))")
    parser.add_argument("--bulk_threshold_mib", type=float, default=None,
                        help="the least a transfer over them moves, MiB "
                             "(Client(bulk_threshold=); default: the client's)")
    parser.add_argument("--breakdown", action="store_true",
                        help="also print where each transport's step time went")
    parser.add_argument("--phases", action="store_true",
                        help="also print the time each step spends in the worker path's "
                             "functions (wrapped in place)")
    parser.add_argument("--profile", type=int, default=0, metavar="K",
                        help="also profile the timed steps of each transport (cProfile) and "
                             "print the K functions with the most time of their own")
    parser.add_argument("--gpu_busy_ms", type=float, default=0,
                        help="queue this many ms of GPU work at each step's start, inside its "
                             "time (a model's forward still running when its loss is called); "
                             "the overhead column then leaves it out")
    parser.add_argument("--host_targets", action="store_true",
                        help="give flce the targets in host memory (eager keeps them on the "
                             "device)")
    parser.add_argument("--no_gpu_fence", action="store_true",
                        help="diagnostic, not a way to run: the worker's stream does not wait "
                             "on the GPU for a CUDA IPC Forward's answer (backward still reads "
                             "it on the host before the gradients are used; the loss may be "
                             "read early). Shows what the waiting stream costs the server's "
                             "engine time (the GPU switching to the worker's context)")
    parser.add_argument("--channel_wakes", action="store_true",
                        help="also count the timed steps' call-channel calls that found the "
                             "server's channel thread asleep, by method")
    parser.add_argument("--timeline", action="store_true",
                        help="also print when, within a step, the worker and the server "
                             "reached each point of the call (the server logs at DEBUG level)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    transports = [t for t in args.transports.split(",") if t]
    phases = Phases() if args.phases else None
    wakes = ChannelWakes() if args.channel_wakes else None
    if args.no_gpu_fence:
        wrap_in_place("flce.cuda_ipc", "CudaIpcRegistry.wait_fence",
                      lambda f, static: lambda *a, **k: None)
    if args.gpu_busy_ms > 0 and device.type != "cuda":
        parser.error("--gpu_busy_ms needs --device=cuda")
    busy = GpuBusy(args.gpu_busy_ms) if args.gpu_busy_ms > 0 else None
    timeline = Timeline() if args.timeline else None
    server = ServerProcess(args.server_binary, f"--backend={args.backend}",
                           "--enable_shared_memory", f"--max_message_bytes={1 << 30}",
                           *(("--log_level=debug",) if args.timeline else ()),
                           *args.server_flags.split())
    rows = []
    try:
        bulk = dict(bulk_connections=args.bulk_connections)
        if args.bulk_threshold_mib is not None:
            bulk["bulk_threshold"] = int(args.bulk_threshold_mib * 2 ** 20)
        client = flce.Client(server.address, max_message_bytes=1 << 30, **bulk)
        grpc_client = flce.Client(server.address, max_message_bytes=1 << 30, call_channel=False,
                                  **bulk)
        info = client.info()
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        bare = []
        for _ in range(50):
            start = time.perf_counter()
            client.info()
            bare.append((time.perf_counter() - start) * 1e3)
        print(f"worker on {name} ({args.dtype}); server backend {info.backend}; "
              f"median of {args.iters} steps after {args.warmup}, forward + backward; "
              f"a bare GetServerInfo round trip: {statistics.median(bare):.3f} ms"
              + (f"; each step (worker, eager) after {args.gpu_busy_ms:g} ms of GPU work "
                 f"queued at its start, which the overhead leaves out" if busy else "")
              + ("; flce's targets in host memory" if args.host_targets else "")
              + ("; DIAGNOSTIC: no GPU fence" if args.no_gpu_fence else ""))
        print(f"{'N×H×V':<18} {'transport':<13} {'worker ms':>10} {'engine ms':>10} "
              f"{'overhead':>9} {'eager ms':>9} {'vs eager':>9} {'extra GiB':>10} "
              f"{'eager extra':>12}")
        for shape in args.shapes.split(","):
            n, h, v = (int(x) for x in shape.split("x"))
            torch.manual_seed(0)
            hidden = torch.randn(n, h, device=device).to(dtype)
            weight = (torch.randn(v, h, device=device) / h ** 0.5).to(dtype)
            target = torch.randint(0, v, (n,), device=device)
            flce_target = target.cpu() if args.host_targets else target
            eager, eager_extra, _ = time_steps(eager_step, hidden, weight, target,
                                               args.warmup, args.iters, busy)
            eager_ms = statistics.median(eager)
            for transport in transports:
                kind, _, pieces = transport.partition(":")  # registered:K, K row pieces
                module = flce.RemoteLinearCrossEntropy(
                    grpc_client if kind.endswith("_grpc") else client,
                    cuda_ipc=kind.startswith("cuda_ipc"),
                    shared_memory=kind.startswith("shm"),
                    register_weight=kind.startswith("registered"),
                    pipeline_min_piece_bytes=int(args.min_piece_mib * 2 ** 20),
                    pipeline_pieces=(1 if kind == "registered_one_call"
                                     else int(pieces or args.pieces)))
                step = flce_step(module)
                if phases is not None:
                    step = phases.wrap(step)
                if wakes is not None:
                    step = profiled(step, wakes, args.warmup)
                if timeline is not None:
                    timeline.module = module
                    step = timeline.wrap(step)
                profiler = None
                if args.profile:
                    import cProfile

                    profiler = cProfile.Profile()
                    step = profiled(step, profiler, args.warmup)
                try:
                    times, extra, engine = time_steps(step, hidden, weight, flce_target,
                                                      args.warmup, args.iters, busy)
                    pull_ms = time_pull(module, hidden, weight, target)
                    engine = [s() for s in engine]  # every call answered now
                finally:
                    module.close()
                if phases is not None:
                    phases.print(shape, transport, args.warmup)
                if wakes is not None:
                    wakes.print(shape, transport)
                if timeline is not None:
                    timeline.print(shape, transport, args.warmup, server)
                if profiler is not None:
                    import io
                    import pstats

                    text = io.StringIO()
                    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(
                        args.profile)
                    print(f"  {shape} {transport} profile of {args.iters} steps:\n"
                          + "\n".join("    " + line for line in text.getvalue().splitlines()
                                       if line.strip()), flush=True)
                worker_ms = statistics.median(times)
                engine_ms = statistics.median(s["engine"] for s in engine)
                row = {"shape": shape, "dtype": args.dtype, "transport": transport,
                       "worker_ms": worker_ms, "worker_best_ms": min(times),
                       "engine_ms": engine_ms, "gpu_busy_ms": args.gpu_busy_ms,
                       "overhead_ms": worker_ms - engine_ms - args.gpu_busy_ms,
                       "eager_ms": eager_ms, "worker_over_eager": worker_ms / eager_ms,
                       "extra_gib": extra / 2 ** 30, "eager_extra_gib": eager_extra / 2 ** 30,
                       "device": name, "backend": info.backend,
                       "phases_ms": {key: statistics.median(s[key] for s in engine)
                                     for key in engine[0]}}
                rows.append(row)
                print(f"{shape:<18} {transport:<13} {worker_ms:>10.2f} {engine_ms:>10.2f} "
                      f"{worker_ms - engine_ms - args.gpu_busy_ms:>9.2f} {eager_ms:>9.2f} "
                      f"{worker_ms / eager_ms:>9.3f} {extra / 2 ** 30:>10.3f} "
                      f"{eager_extra / 2 ** 30:>12.3f}", flush=True)
                if pull_ms is not None:
                    row["pull_ms"] = pull_ms
                    print(f"  {shape} {transport}: the summed dW pulled into .grad once per "
                          f"optimizer step (TakeWeightGrad): {pull_ms:.1f} ms", flush=True)
                if args.breakdown:
                    print_breakdown(shape, transport, times, engine, server)
            del hidden, weight, target
            if device.type == "cuda":
                torch.cuda.empty_cache()
        client.close()
        grpc_client.close()
    finally:
        server.kill()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
