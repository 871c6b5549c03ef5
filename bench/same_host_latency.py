"""What one same-host hop costs: the primitives a worker's call is made of, timed.

A same-host Forward is a chain of wake-ups: the worker's request wakes a
server thread, the server's stream synchronisation wakes it when the GPU is
done, its answer wakes the worker. Each hop's price depends on how long the
waiting thread slept (an idle CPU, in a virtual machine a halted vCPU, takes
longer to wake). This prints, for each primitive and each idle time before
it, the median and 90th percentile of a round trip in microseconds:

- ``futex``: two processes ping-pong through a word in shared memory, each
  waiting in futex(2) (two wake-ups per round trip);
- ``spin``: the same, the answering process spinning on the word;
- ``grpc tcp`` / ``grpc unix``: a Python gRPC GetServerInfo round trip to
  flce_server over loopback TCP / a Unix domain socket;
- ``cuda sync``: (GPU only) a kernel of the idle time's length, then
  ``cudaStreamSynchronize``: host wall time minus the kernel's own time, with
  the default scheduling and with a blocking-sync event;
- ``cuda after peer``: (GPU only) another process runs a kernel of the idle
  time's length (``gpu``) or sleeps as long on its CPU (``cpu``), then this
  one launches a tiny kernel and synchronises: the time from the other's
  signal to the synchronisation's return (the difference between the two is
  what switching the GPU between two processes' contexts costs).

Usage: same_host_latency.py FLCE_SERVER [--iters 200] [--idle 0,1,10,40]
Needs the flce package and server_process.py on PYTHONPATH; torch for the
CUDA rows.
"""

import argparse
import ctypes
import itertools
import mmap
import os
import statistics
import struct
import sys
import tempfile
import time

import flce
from server_process import ServerProcess

_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def futex(addr, op, value):
    return _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), op, value, None, None, 0)


class Word:
    """A 32-bit word in an anonymous shared mapping (inherited by fork)."""

    def __init__(self, mapping, offset):
        self.mapping, self.offset = mapping, offset
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(mapping, offset))

    def get(self):
        return struct.unpack_from("<I", self.mapping, self.offset)[0]

    def set(self, value):
        struct.pack_into("<I", self.mapping, self.offset, value)

    def wait_while(self, value, spin):
        while self.get() == value:
            if not spin:
                futex(self.addr, _FUTEX_WAIT, value)

    def wake(self):
        futex(self.addr, _FUTEX_WAKE, 1)


def ping_pong(idle_ms, iters, spin):
    """Round trips between this process and a child through shared words."""
    mapping = mmap.mmap(-1, 4096)
    ping, pong = Word(mapping, 0), Word(mapping, 64)
    pid = os.fork()
    if pid == 0:  # the answering side
        seen = 0
        while True:
            ping.wait_while(seen, spin)
            seen = ping.get()
            if seen == 0xFFFFFFFF:
                os._exit(0)
            pong.set(seen)
            pong.wake()
    times = []
    for i in range(1, iters + 1):
        if idle_ms:
            time.sleep(idle_ms / 1e3)
        start = time.perf_counter()
        ping.set(i)
        ping.wake()
        pong.wait_while(i - 1, spin=False)
        times.append((time.perf_counter() - start) * 1e6)
    ping.set(0xFFFFFFFF)
    ping.wake()
    os.waitpid(pid, 0)
    return times


def grpc_round_trips(address, idle_ms, iters):
    client = flce.Client(address)
    try:
        for _ in range(10):
            client.info()
        times = []
        for _ in range(iters):
            if idle_ms:
                time.sleep(idle_ms / 1e3)
            start = time.perf_counter()
            client.info()
            times.append((time.perf_counter() - start) * 1e6)
        return times
    finally:
        client.close()


def cuda_sync(idle_ms, iters, blocking):
    """Host wall time of launch + synchronise minus the kernel's own time."""
    import torch

    start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    done = torch.cuda.Event(blocking=True) if blocking else None
    # Cycles per millisecond of torch.cuda._sleep, measured.
    start_ev.record()
    torch.cuda._sleep(10_000_000)
    end_ev.record()
    end_ev.synchronize()
    cycles_per_ms = 10_000_000 / start_ev.elapsed_time(end_ev)
    cycles = max(1, int(cycles_per_ms * max(idle_ms, 0.01)))
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        wall = time.perf_counter()
        start_ev.record()
        torch.cuda._sleep(cycles)
        end_ev.record()
        if done is not None:
            done.record()
            done.synchronize()
        else:
            torch.cuda.current_stream().synchronize()
        wall = (time.perf_counter() - wall) * 1e6
        times.append(wall - start_ev.elapsed_time(end_ev) * 1e3)
    return times


_PEER = """
import mmap, struct, sys, time, torch
from multiprocessing import shared_memory
shm = shared_memory.SharedMemory(name=sys.argv[1])
# Attached, not owned: its creator unlinks it (not this process's tracker).
from multiprocessing import resource_tracker
resource_tracker.unregister(shm._name, "shared_memory")
buf = shm.buf
cycles_per_ms = float(sys.argv[2])
torch.cuda.init(); torch.cuda._sleep(1000); torch.cuda.synchronize()
struct.pack_into("<I", buf, 8, 1)  # ready
seen = 0
while True:
    while struct.unpack_from("<I", buf, 0)[0] == seen:
        pass
    seen, mode, ms = struct.unpack_from("<IIf", buf, 0)
    if mode == 2:
        break
    if mode == 1:
        torch.cuda._sleep(int(cycles_per_ms * ms)); torch.cuda.synchronize()
    else:
        time.sleep(ms / 1e3)
    struct.pack_into("<I", buf, 4 * 8, seen)  # done
del buf
shm.close()
"""


_PEER_CALLS = itertools.count(1)


def cuda_after_peer(idle_ms, iters, peer_on_gpu, peer):
    """Time from the peer's done signal to this process's tiny kernel's end."""
    import torch

    shm, process, cycles_per_ms = peer
    buf = shm.buf
    times = []
    for _ in range(iters):
        seq = next(_PEER_CALLS)
        torch.cuda.synchronize()
        struct.pack_into("<IIf", buf, 0, seq, 1 if peer_on_gpu else 0, idle_ms)
        while struct.unpack_from("<I", buf, 32)[0] != seq:
            pass
        start = time.perf_counter()
        torch.cuda._sleep(1)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e6)
    return times


def start_peer():
    import subprocess

    import torch
    from multiprocessing import shared_memory

    start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start_ev.record()
    torch.cuda._sleep(10_000_000)
    end_ev.record()
    end_ev.synchronize()
    cycles_per_ms = 10_000_000 / start_ev.elapsed_time(end_ev)
    shm = shared_memory.SharedMemory(create=True, size=4096)
    process = subprocess.Popen([sys.executable, "-c", _PEER, shm.name, str(cycles_per_ms)])
    while struct.unpack_from("<I", shm.buf, 8)[0] != 1:
        time.sleep(0.01)
    return shm, process, cycles_per_ms


def stop_peer(peer):
    shm, process, _ = peer
    struct.pack_into("<IIf", shm.buf, 0, 0xFFFFFFFF, 2, 0.0)
    process.wait()
    shm.close()
    shm.unlink()


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("server_binary")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--idle", default="0,1,10,40")
    args = parser.parse_args(argv)
    idles = [float(x) for x in args.idle.split(",")]
    socket_dir = tempfile.mkdtemp()
    unix = f"unix:{socket_dir}/flce.sock"
    tcp_server = ServerProcess(args.server_binary, "--backend=cpu")
    unix_server = ServerProcess(args.server_binary, "--backend=cpu", address=unix)
    rows = []

    def row(name, idle, times):
        times = sorted(times)
        rows.append((name, idle, statistics.median(times), times[int(0.9 * (len(times) - 1))]))
        print(f"{name:<22} {idle:>8g} {rows[-1][2]:>10.1f} {rows[-1][3]:>10.1f}", flush=True)

    print(f"{'round trip':<22} {'idle ms':>8} {'median us':>10} {'p90 us':>10}")
    try:
        for idle in idles:
            iters = args.iters if idle < 10 else max(20, args.iters // 4)
            row("futex", idle, ping_pong(idle, iters, spin=False))
            row("spin", idle, ping_pong(idle, iters, spin=True))
            row("grpc tcp", idle, grpc_round_trips(tcp_server.address, idle, iters))
            row("grpc unix", idle, grpc_round_trips(unix, idle, iters))
        try:
            import torch

            if torch.cuda.is_available():
                for idle in idles:
                    iters = args.iters if idle < 10 else max(20, args.iters // 4)
                    row("cuda sync default", idle, cuda_sync(idle, iters, blocking=False))
                    row("cuda sync blocking", idle, cuda_sync(idle, iters, blocking=True))
                peer = start_peer()
                try:
                    for idle in idles:
                        iters = args.iters if idle < 10 else max(20, args.iters // 4)
                        row("cuda after peer cpu", idle, cuda_after_peer(idle, iters, False, peer))
                        row("cuda after peer gpu", idle, cuda_after_peer(idle, iters, True, peer))
                finally:
                    stop_peer(peer)
        except ImportError:
            pass
    finally:
        tcp_server.kill()
        unix_server.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
