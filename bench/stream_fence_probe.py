"""Can a worker's GPU stream wait for another process's host-side signal?

The question behind an asynchronous same-host Forward: the worker enqueues
``cuStreamWaitValue32`` on a word of shared host memory (registered with
``cudaHostRegister``) and goes on; another process (the server) runs its GPU
work, synchronises, then stores the word. This prints, per length of the
other process's work: how long after the store the worker's next kernel
finished (``fence``), and the same when the worker polls the word on the
host and only then launches the kernel (``host poll``); and whether the
other process's kernel was delayed by the waiting stream (``peer late``:
its wall time minus its kernel time).

Usage: stream_fence_probe.py [--iters 30] [--work 1,5,40]   (GPU only)
"""

import argparse
import ctypes
import statistics
import struct
import subprocess
import sys
import time
from multiprocessing import shared_memory

import torch

_PEER = """
import struct, sys, time, torch
from multiprocessing import shared_memory
shm = shared_memory.SharedMemory(name=sys.argv[1])
# Attached, not owned: its creator unlinks it (not this process's tracker).
from multiprocessing import resource_tracker
resource_tracker.unregister(shm._name, "shared_memory")
buf = shm.buf
cycles_per_ms = float(sys.argv[2])
torch.cuda.init(); torch.cuda._sleep(1000); torch.cuda.synchronize()
struct.pack_into("<I", buf, 128, 1)  # ready
seen = 0
while True:
    while struct.unpack_from("<I", buf, 64)[0] == seen:
        pass
    seen = struct.unpack_from("<I", buf, 64)[0]
    ms = struct.unpack_from("<f", buf, 68)[0]
    if ms < 0:
        break
    start = time.perf_counter()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record(); torch.cuda._sleep(int(cycles_per_ms * ms)); end.record()
    torch.cuda.synchronize()
    # Wall time beyond the kernel's own: launch, waiting for the GPU, sync.
    struct.pack_into("<d", buf, 256, (time.perf_counter() - start) * 1e3 - begin.elapsed_time(end))
    struct.pack_into("<d", buf, 192, time.perf_counter())  # when the word is stored
    struct.pack_into("<I", buf, 0, seen)                  # the fence word
del buf
shm.close()
"""


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--work", default="1,5,40")
    args = parser.parse_args(argv)
    cuda = ctypes.CDLL("libcuda.so.1")
    wait_value = cuda.cuStreamWaitValue32_v2
    wait_value.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    get_pointer = cuda.cuMemHostGetDevicePointer_v2
    get_pointer.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]

    start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start_ev.record()
    torch.cuda._sleep(10_000_000)
    end_ev.record()
    end_ev.synchronize()
    cycles_per_ms = 10_000_000 / start_ev.elapsed_time(end_ev)

    shm = shared_memory.SharedMemory(create=True, size=4096)
    buf = shm.buf
    host = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    err = torch.cuda.cudart().cudaHostRegister(host, 4096, 0)
    print("cudaHostRegister:", err)
    device_ptr = ctypes.c_uint64()
    print("cuMemHostGetDevicePointer:", get_pointer(ctypes.byref(device_ptr), host, 0),
          hex(device_ptr.value), "host", hex(host))
    peer = subprocess.Popen([sys.executable, "-c", _PEER, shm.name, str(cycles_per_ms)])
    while struct.unpack_from("<I", buf, 128)[0] != 1:
        time.sleep(0.01)
    seq = 0
    stream = torch.cuda.current_stream()
    print(f"{'peer work ms':>12} {'mode':>10} {'after store us':>15} {'p90':>8} {'peer late us':>13}")
    try:
        for work in [float(x) for x in args.work.split(",")]:
            for mode in ("fence", "host poll"):
                after, late = [], []
                for _ in range(args.iters):
                    torch.cuda.synchronize()
                    seq += 1
                    struct.pack_into("<f", buf, 68, work)
                    struct.pack_into("<I", buf, 64, seq)  # the peer starts
                    if mode == "fence":
                        result = wait_value(ctypes.c_void_p(stream.cuda_stream), device_ptr.value,
                                            seq, 0)  # CU_STREAM_WAIT_VALUE_GEQ
                        if result != 0:
                            raise RuntimeError(f"cuStreamWaitValue32: {result}")
                        torch.cuda._sleep(1)
                        torch.cuda.synchronize()
                    else:
                        while struct.unpack_from("<I", buf, 0)[0] != seq:
                            pass
                        torch.cuda._sleep(1)
                        torch.cuda.synchronize()
                    done = time.perf_counter()
                    stored = struct.unpack_from("<d", buf, 192)[0]
                    after.append((done - stored) * 1e6)
                    late.append(struct.unpack_from("<d", buf, 256)[0] * 1e3)
                after.sort()
                print(f"{work:>12g} {mode:>10} {statistics.median(after):>15.1f} "
                      f"{after[int(0.9 * (len(after) - 1))]:>8.1f} {statistics.median(late):>13.1f}",
                      flush=True)
    finally:
        struct.pack_into("<f", buf, 68, -1.0)
        struct.pack_into("<I", buf, 64, seq + 1)
        peer.wait()
        torch.cuda.cudart().cudaHostUnregister(host)
        del buf
        shm.close()
        shm.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
