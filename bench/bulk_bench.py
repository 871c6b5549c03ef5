"""What a remote worker waits for to move bytes: the Python client's bulk transfers.

Starts its own flce_server (``--backend``, loopback TCP) and times, median
of ``--iters`` after one warm-up each:

- ``region``: raw bytes written into a region of the server's memory and
  read back through :class:`flce.bulk.BulkTransfer`, for each transport
  (``http``: the server's bulk port; ``grpc``: WriteRegion / ReadRegion
  streams, for each read part size and with each part's CRC-32 on or
  off), size and connection count: GB/s each way;
- ``duplex``: over the bulk HTTP port, a write and a read of each size
  alone and at once (the read from its own range, on a thread of its own),
  for each connection count: as a remote worker's row pieces move the next
  piece's X up while the last piece's dX comes down; then reads back to
  back with writes back to back beside them, the reads in a thread of the
  writer's process and in a process of their own (whether the two slow
  each other in the wire and the server, or in one interpreter);
- ``weight``: ``Client.put_weight`` of a bf16 weight of each size and
  ``take_weight_grad(out=...)`` of its gradient in bf16 (one tiny Backward
  accumulates into it before each take), for each transport and
  connection count (0: one stream over the client's one channel): seconds
  and GB/s, and the server's own part of each (its access lines' ms: the
  PutWeight after the bytes are in the region, the TakeWeightGrad before
  they are read out of it).

Usage: bulk_bench.py FLCE_SERVER [--backend cuda] [--sizes_mib 64,1024]
  [--transports http,grpc] [--connections 1,2,4,8] [--part_mib 1,4,16]
  [--crc 1,0] [--what region,duplex,weight] [--iters 3] [--json PATH]
Needs the flce package (and torch for ``weight``) and server_process.py on
PYTHONPATH.
"""

import argparse
import json
import re
import statistics
import sys
import time

import numpy as np

import flce
import flce.bulk
from server_process import ServerProcess


def timed(fn, iters):
    fn()  # warm-up: regions made, connections up, pages touched
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def region_rows(address, transports, sizes, connections, parts, crcs, iters):
    rows = []
    for size in sizes:
        data = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
        back = np.empty_like(data)
        configs = [("http", c, 0, False) for c in connections if "http" in transports]
        configs += [("grpc", c, p, k) for c in connections for p in parts for k in crcs
                    if "grpc" in transports]
        for transport, conns, part, crc in configs:
            client = flce.Client(address, bulk_connections=conns, bulk_http=transport == "http",
                                 stream_chunk_bytes=part or (4 << 20),
                                 max_message_bytes=(part or (4 << 20)) + (1 << 20))
            try:
                bulk = client.bulk(size)
                bulk.checksums = crc
                region = bulk.region(size)
                if bulk.over_http != (transport == "http"):
                    raise AssertionError(f"asked for {transport}, got the other transport")
                write_part = min(part, flce.bulk.WRITE_PART_BYTES)
                put = timed(lambda: bulk.write(region, 0, data, 300.0), iters)
                take = timed(lambda: bulk.read(region, 0, back, 300.0), iters)
                if not np.array_equal(back, data):
                    raise AssertionError("the region did not read back what was written")
            finally:
                client.close()
            rows.append({"what": "region", "transport": transport, "bytes": size,
                         "connections": conns, "write_part_bytes": write_part,
                         "read_part_bytes": part, "crc32": crc, "write_s": put, "read_s": take,
                         "write_gbps": size / put / 1e9, "read_gbps": size / take / 1e9})
            how = ("" if transport == "http" else
                   f"parts {write_part >> 20:>2}/{part >> 20:<2} MiB  crc {'on ' if crc else 'off'}")
            print(f"region {transport:<4} {size >> 20:>6} MiB  {conns:>2} conn  {how:<26} "
                  f"write {put * 1e3:9.1f} ms {size / put / 1e9:6.2f} GB/s  "
                  f"read {take * 1e3:9.1f} ms {size / take / 1e9:6.2f} GB/s", flush=True)
    return rows


_READER = r"""
import concurrent.futures, json, sys, time
from flce import bulk_http
host, port, region, ticket = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
offset, size, reps = (int(a) for a in sys.argv[5:8])
spans = json.loads(sys.argv[8])  # the writer's client's ranges (BulkTransfer's split)
http = bulk_http.BulkHttp(host, port, timeout=300.0, max_connections=len(spans))
out = memoryview(bytearray(size))
pool = concurrent.futures.ThreadPoolExecutor(len(spans))
def read():
    fs = [pool.submit(http.get, region, ticket, offset + a, out[a:b]) for a, b in spans]
    for f in fs:
        f.result()
read()
print("ready", flush=True)
sys.stdin.readline()
times = []
for _ in range(reps):
    start = time.perf_counter()
    read()
    times.append(time.perf_counter() - start)
print(json.dumps(times), flush=True)
"""


def _reads_during(reader, write, writing: bool):
    """(median read s, median write s or None): ``reader()`` runs its reads
    (a callable returning their times), ``write()`` back to back beside them
    while ``writing``."""
    import threading

    result = {}
    thread = threading.Thread(target=lambda: result.update(times=reader()))
    thread.start()
    writes = []
    while writing and thread.is_alive():
        start = time.perf_counter()
        write()
        writes.append(time.perf_counter() - start)
    thread.join()
    return statistics.median(result["times"]), (statistics.median(writes) if writes else None)


def duplex_rows(address, sizes, connections, iters):
    import subprocess
    import threading

    rows = []
    for size in sizes:
        data = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
        back = np.empty_like(data)
        for conns in connections:
            client = flce.Client(address, bulk_connections=conns, bulk_http=True)
            try:
                bulk = client.bulk(size)
                region = bulk.region(2 * size)
                if not bulk.over_http:
                    raise AssertionError("no bulk HTTP port")
                bulk.write(region, size, data, 300.0)

                def write():
                    bulk.write(region, 0, data, 300.0)

                def read():
                    bulk.read(region, size, back, 300.0)

                def both():
                    reader = threading.Thread(target=read)
                    reader.start()
                    write()
                    reader.join()

                alone_w, alone_r, at_once = (timed(f, iters) for f in (write, read, both))
                if not np.array_equal(back, data):
                    raise AssertionError("the region did not read back what was written")
                reps = 4 * iters

                def reads_here():
                    times = []
                    for _ in range(reps):
                        start = time.perf_counter()
                        read()
                        times.append(time.perf_counter() - start)
                    return times

                def reads_in_process():
                    child = subprocess.Popen(
                        [sys.executable, "-c", _READER, bulk._http.host, str(bulk._http.port),
                         region, bulk._ticket, str(size), str(size), str(reps),
                         json.dumps([(r.start, r.stop) for r in bulk._http_ranges(size)])],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                    assert child.stdout.readline().strip() == "ready"
                    child.stdin.write("go\n")
                    child.stdin.flush()
                    times = json.loads(child.stdout.readline())
                    child.wait()
                    return times

                thread_r, _ = _reads_during(reads_here, write, False)
                thread_rw, thread_wr = _reads_during(reads_here, write, True)
                proc_r, _ = _reads_during(reads_in_process, write, False)
                proc_rw, proc_wr = _reads_during(reads_in_process, write, True)
            finally:
                client.close()
            rows.append({"what": "duplex", "bytes": size, "connections": conns,
                         "write_s": alone_w, "read_s": alone_r, "both_s": at_once,
                         "thread_read_s": thread_r, "thread_read_while_writing_s": thread_rw,
                         "thread_write_while_reading_s": thread_wr,
                         "process_read_s": proc_r, "process_read_while_writing_s": proc_rw,
                         "process_write_while_reading_s": proc_wr})
            print(f"duplex http {size >> 20:>6} MiB  {conns:>2} conn  write {alone_w * 1e3:7.2f} ms  "
                  f"read {alone_r * 1e3:7.2f} ms  both at once {at_once * 1e3:7.2f} ms "
                  f"({at_once / max(alone_w, alone_r):.2f}x the longer alone)", flush=True)
            print(f"  reads back to back, writes beside them: in a thread of the writer's "
                  f"process read {thread_r * 1e3:.2f} alone, {thread_rw * 1e3:.2f} while "
                  f"writes take {thread_wr * 1e3:.2f} ms; in a process of their own read "
                  f"{proc_r * 1e3:.2f} alone, {proc_rw * 1e3:.2f} while writes take "
                  f"{proc_wr * 1e3:.2f} ms", flush=True)
    return rows


def server_ms(server, rpc, name, last):
    """The median ms of the server's last `last` access lines of `rpc` on
    weight `name`."""
    found = re.findall(rf"rpc={rpc} weight={re.escape(name)} .*? ms=([0-9.]+)",
                       server.read_log())
    return statistics.median(float(ms) for ms in found[-last:]) if found else float("nan")


def weight_rows(server, transports, sizes, connections, iters):
    address = server.address
    import torch

    rows = []
    h = 4096
    for size in sizes:
        v = max(1, size // (2 * h))
        weight = (torch.randn(v, h) / h ** 0.5).to(torch.bfloat16)
        out = torch.empty_like(weight)
        x = torch.randn(1, h).to(torch.bfloat16)
        t = torch.zeros(1, dtype=torch.int64)
        for transport, conns in ((t, c) for t in transports for c in connections
                                 if c > 0 or t == transports[0]):
            client = flce.Client(address, bulk_connections=conns, bulk_http=transport == "http")
            name = f"bench-{transport}-{conns}"
            try:
                put = timed(lambda: client.put_weight(name, weight), iters)

                def take():
                    r = client.forward(x, t, weight_name=name, need_backward=True)
                    client.backward(r.session_id, accumulate_weight_grad=True)
                    start = time.perf_counter()
                    client.take_weight_grad(name, float32=False, out=(out, None))
                    return time.perf_counter() - start

                take()
                take_s = statistics.median(take() for _ in range(iters))
                client.delete_weight(name)
            finally:
                client.close()
            nbytes = weight.numel() * 2
            transport = transport if conns else "one stream"
            put_server = server_ms(server, "PutWeight", name, iters)
            take_server = server_ms(server, "TakeWeightGrad", name, iters)
            rows.append({"what": "weight", "transport": transport, "bytes": nbytes,
                         "put_server_ms": put_server, "take_server_ms": take_server,
                         "connections": conns,
                         "put_s": put, "take_s": take_s, "put_gbps": nbytes / put / 1e9,
                         "take_gbps": nbytes / take_s / 1e9})
            print(f"weight {transport:<10} {nbytes >> 20:>6} MiB  {conns:>2} conn  put {put:7.3f} s "
                  f"{nbytes / put / 1e9:6.2f} GB/s (server {put_server:6.1f} ms)  take "
                  f"{take_s:7.3f} s {nbytes / take_s / 1e9:6.2f} GB/s (server "
                  f"{take_server:6.1f} ms)", flush=True)
    return rows


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("server_binary")
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--sizes_mib", default="64,1024")
    parser.add_argument("--transports", default="http,grpc")
    parser.add_argument("--connections", default="1,2,4,8")
    parser.add_argument("--part_mib", default="1,4,16",
                        help="parts of the reads (the writes': at most 1 MiB, the client's)")
    parser.add_argument("--crc", default="1", help="1, 0 or 1,0: each part's CRC-32 on or off")
    parser.add_argument("--what", default="region,weight")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    sizes = [int(s) << 20 for s in args.sizes_mib.split(",")]
    connections = [int(c) for c in args.connections.split(",")]
    parts = [int(p) << 20 for p in args.part_mib.split(",")]
    what = args.what.split(",")
    transports = args.transports.split(",")
    server = ServerProcess(args.server_binary, f"--backend={args.backend}",
                           f"--region_memory_bytes={4 * max(sizes) + (1 << 30)}")
    rows = []
    try:
        print(f"Python client over loopback TCP to a {args.backend} server; median of "
              f"{args.iters} after one", flush=True)
        if "region" in what:
            rows += region_rows(server.address, transports, sizes,
                                [c for c in connections if c > 0], parts,
                                [c == "1" for c in args.crc.split(",")], args.iters)
        if "duplex" in what:
            rows += duplex_rows(server.address, sizes, [c for c in connections if c > 0],
                                args.iters)
        if "weight" in what:
            rows += weight_rows(server, transports, sizes, connections, args.iters)
    finally:
        server.kill()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
