"""CUDA IPC against inline bytes: one training step's loss through flce.

Times Forward + Backward of RemoteLinearCrossEntropy on GPU tensors, once
with hidden, weight and their gradients as bytes in the messages and once
through CUDA IPC (the server reads and writes this process's GPU memory),
against a flce_server it starts on the CUDA backend. Prints a table: median
and best of --iters round trips after one warm-up, and the bytes each path
moves through gRPC. Needs a GPU, PyTorch with CUDA, and the flce package and
server_process.py on PYTHONPATH.

Usage: ipc_bench.py FLCE_SERVER [--shape NxHxV] [--iters K]
"""

import argparse
import statistics
import sys
import time

import torch

import flce
from server_process import ServerProcess


def time_steps(module, hidden, weight, target, iters):
    times = []
    for i in range(iters + 1):
        h = hidden.detach().requires_grad_()
        w = weight.detach().requires_grad_()
        torch.cuda.synchronize()
        start = time.perf_counter()
        module(h, w, target).backward()
        torch.cuda.synchronize()
        if i > 0:  # the first is a warm-up
            times.append((time.perf_counter() - start) * 1e3)
    return times


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("server_binary")
    parser.add_argument("--shape", default="4096x4096x16384")
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args(argv)
    n, h, v = (int(x) for x in args.shape.split("x"))
    server = ServerProcess(args.server_binary, "--backend=cuda", "--enable_shared_memory",
                           f"--max_message_bytes={1 << 30}")
    try:
        client = flce.Client(server.address, max_message_bytes=1 << 30)
        torch.manual_seed(0)
        hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
        weight = (torch.randn(v, h, device="cuda") / h ** 0.5).to(torch.bfloat16)
        target = torch.randint(0, v, (n,), device="cuda")
        tensor_bytes = 2 * (n * h + v * h) * 2  # X, W in; dX, dW out (bf16)
        print(f"{n}x{h}x{v} bf16, Forward+Backward round trip, {args.iters} iterations, "
              f"{torch.cuda.get_device_name()}")
        print(f"{'path':<8} {'median ms':>10} {'best ms':>9} {'MB through gRPC':>16}")
        for name, cuda_ipc in (("inline", False), ("cuda_ipc", True)):
            module = flce.RemoteLinearCrossEntropy(client, cuda_ipc=cuda_ipc)
            times = time_steps(module, hidden, weight, target, args.iters)
            moved = (n * 8 if cuda_ipc else tensor_bytes + n * 8) / 1e6
            print(f"{name:<8} {statistics.median(times):>10.1f} {min(times):>9.1f} {moved:>16.1f}")
        client.close()
    finally:
        server.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
