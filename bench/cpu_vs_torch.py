"""The CPU engine beside PyTorch's CPU eager, in one run, on the same machine.

For each shape and dtype, in rounds that take turns (so that a drift of the
machine's speed falls on both): ``flce_bench --backend=cpu`` (the engine's
Forward + Backward, STORE_GRADS by default, on its own process's threads),
then PyTorch eager ``F.cross_entropy(F.linear(x, w).float(), t)`` forward +
backward in this process with as many threads. Prints each one's median over
the rounds of its medians, the spread, and flce / torch; ``--json`` writes
the rows too. PyTorch has no CPU fp16 matmul (``addmm`` is not implemented
for Half): its fp16 row computes in fp32 on the fp16 values, what a user
must do there, and says so.

Usage: cpu_vs_torch.py FLCE_BENCH [--shapes 512x1024x32000] [--dtypes bf16,fp16,fp32]
  [--modes store_grads] [--rounds 3] [--iters 5] [--threads N] [--json PATH]
  [--flce_flags "FLAGS;FLAGS..."]
``--flce_flags`` times flce_bench once per variant of extra flags (';'
between variants, e.g. ";--cpu_onednn_fp32=false": the default, then
OpenBLAS's fp32 GEMMs), every variant and torch taking turns in each round.
Needs PyTorch (Debian's python3-torch: run with /usr/bin/python3).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def flce_ms(flce_bench, shape, dtype, mode, iters, threads, flags=()):
    """The engine's median ms from one flce_bench process (more flags: `flags`)."""
    out = subprocess.run(
        [flce_bench, "--backend=cpu", f"--shapes={shape}", f"--dtypes={dtype}",
         f"--modes={mode}", f"--iters={iters}", "--warmup=1", "--floor=false",
         "--check_shape=0", "--json", *flags],
        check=True, capture_output=True, text=True,
        env=dict(os.environ, OMP_NUM_THREADS=str(threads))).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    if not rows or rows[0]["error"]:
        raise RuntimeError(f"flce_bench: {out}")
    return rows[0]["engine_ms"]


def torch_ms(shape, dtype, iters):
    """PyTorch eager's median ms (fwd + bwd), and how it computed."""
    n, h, v = (int(d) for d in shape.split("x"))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=g).to(DTYPES[dtype]).requires_grad_()
    w = (torch.randn(v, h, generator=g) / h ** 0.5).to(DTYPES[dtype]).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    how = "native"
    try:
        F.linear(x[:1], w[:1])
    except RuntimeError:
        how = "fp32 compute (no CPU fp16 matmul)"

    def step():
        logits = F.linear(x, w) if how == "native" else F.linear(x.float(), w.float())
        F.cross_entropy(logits.float(), t).backward()
        x.grad = w.grad = None

    step()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), how


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("flce_bench")
    parser.add_argument("--shapes", default="512x1024x32000")
    parser.add_argument("--dtypes", default="bf16,fp16,fp32")
    parser.add_argument("--modes", default="store_grads")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--json")
    parser.add_argument("--flce_flags", default="",
                        help="';'-separated variants of extra flce_bench flags, a row each")
    args = parser.parse_args()
    variants = [tuple(v.split()) for v in args.flce_flags.split(";")]
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads each, {args.rounds} rounds "
          f"of {args.iters} steps (median of the rounds' medians, [min, max])")
    print(f"{'N×H×V':<18} {'dtype':<5} {'mode':<12} {'flce ms':>22} {'torch ms':>22}  "
          f"{'flce/torch':>10}  torch computes{'  (flce flags)' if len(variants) > 1 else ''}")
    rows = []
    for shape in args.shapes.split(","):
        for dtype in args.dtypes.split(","):
            for mode in args.modes.split(","):
                ours, theirs, how = {v: [] for v in variants}, [], ""
                for _ in range(args.rounds):
                    for v in variants:
                        ours[v].append(flce_ms(args.flce_bench, shape, dtype, mode, args.iters,
                                               args.threads, v))
                    ms, how = torch_ms(shape, dtype, args.iters)
                    theirs.append(ms)
                b = statistics.median(theirs)
                for v in variants:
                    a = statistics.median(ours[v])
                    row = dict(shape=shape, dtype=dtype, mode=mode, flce_ms=a, torch_ms=b,
                               flce_rounds=ours[v], torch_rounds=theirs, ratio=a / b,
                               torch_computes=how, threads=args.threads, flce_flags=list(v))
                    rows.append(row)
                    print(f"{shape:<18} {dtype:<5} {mode:<12} "
                          f"{a:8.1f} [{min(ours[v]):5.0f},{max(ours[v]):5.0f}] "
                          f"{b:8.1f} [{min(theirs):5.0f},{max(theirs):5.0f}]  {a / b:10.3f}  "
                          f"{how}{'  ' + (' '.join(v) or '(default)') if len(variants) > 1 else ''}",
                          flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
