"""Data-parallel workers (DDP) whose LM-head loss runs on one flce server.

    pip install flce-<version>-py3-none-any.whl      # tools/build_wheel.sh makes it
    python3 client/python/examples/ddp_train.py --server=localhost:50051 --world=2

Starts ``--world`` worker processes (torch.distributed with gloo, on the
CPU), each with its own flce client, a DistributedDataParallel replica of a
tiny language model and its share of every batch, and trains ``--steps``
optimizer steps with ``--micro_batches`` of gradient accumulation. Then it
trains the same model on the whole batches in this one process with
PyTorch's own loss and prints, for each step, the loss of both and at the
end the largest difference of any parameter, ending with "OK" when the two
agree to fp32 rounding (exit status 0).

Two recipes (``--recipe``):

- ``autograd``: ``RemoteLinearCrossEntropy(..., register_weight=False)``
  hands the head's dW to autograd on every call, so DDP averages it over the
  ranks with every other gradient (its bucketed all-reduce, overlapped with
  the backward) and nothing else in the training loop changes. W travels
  with every call: the choice for a server on the same host (add
  ``cuda_ipc=True``), where nothing is copied.
- ``registered``: each rank's module registers the head's weight once per
  optimizer step and the server sums that rank's dW over its micro-batches,
  so each call moves only X, the targets and dX (the remote choice). The
  head is left out of DDP's all-reduce; before the step each rank pulls its
  sum and the ranks average it with one all-reduce of their own.

Each rank's batch share is its own mean; the average of the ranks' means is
the whole batch's mean when the shares have equal numbers of non-ignored
targets (as here; otherwise use reduction "sum" and divide by the global
count).
"""

import argparse
import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F

import flce
from train_tiny_lm import TinyLM  # its forward gives the hidden states


def batches(args):
    """Every step's micro-batches (tokens, targets), the same in every process."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(args.steps):
        yield [(torch.randint(0, args.vocab, (args.rows, 16), generator=gen),
                torch.randint(0, args.vocab, (args.rows, 16), generator=gen))
               for _ in range(args.micro_batches)]


def worker(rank, args, port, out):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    torch.manual_seed(0)  # the same initial model on every rank
    local = TinyLM(args.vocab, args.hidden)
    registered = args.recipe == "registered"
    if registered:
        # The head's gradient comes from the server's sum, not from autograd.
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            local, ["head.weight", "head.bias"])
    model = torch.nn.parallel.DistributedDataParallel(local)
    head = model.module.head
    loss_fn = flce.RemoteLinearCrossEntropy(args.server, register_weight=registered)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    share = args.rows // args.world
    rows = slice(rank * share, (rank + 1) * share)
    losses = []
    for step_batches in batches(args):
        optimizer.zero_grad()
        total = torch.zeros(())
        for tokens, targets in step_batches:
            loss = loss_fn(model(tokens[rows]), head.weight, targets[rows], head.bias)
            (loss / args.micro_batches).backward()  # DDP averages every gradient
            total += loss.detach() / args.micro_batches
        if registered:
            loss_fn.pull_weight_grads()  # this rank's sum, from the server
            for p in (head.weight, head.bias):
                dist.all_reduce(p.grad)
                p.grad /= args.world
        optimizer.step()
        dist.all_reduce(total)
        losses.append(float(total) / args.world)
    if rank == 0:
        torch.save({"losses": losses, "state": model.module.state_dict()}, out)
    loss_fn.close()
    dist.destroy_process_group()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="localhost:50051")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--recipe", choices=["autograd", "registered"], default="autograd")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--micro_batches", type=int, default=2)
    parser.add_argument("--rows", type=int, default=6, help="rows per micro-batch, all ranks")
    parser.add_argument("--vocab", type=int, default=101)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.5)
    args = parser.parse_args(argv)
    if args.rows % args.world:
        parser.error("--rows must be a multiple of --world")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(tempfile.mkdtemp(), "rank0.pt")
    torch.multiprocessing.spawn(worker, args=(args, port, out), nprocs=args.world)
    ddp = torch.load(out)

    # The same training in one process, with PyTorch's own loss.
    torch.manual_seed(0)
    model = TinyLM(args.vocab, args.hidden)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    for step, step_batches in enumerate(batches(args)):
        optimizer.zero_grad()
        total = 0.0
        for tokens, targets in step_batches:
            logits = model.head(model(tokens))
            loss = F.cross_entropy(logits.reshape(-1, args.vocab), targets.reshape(-1))
            (loss / args.micro_batches).backward()
            total += float(loss.detach()) / args.micro_batches
        optimizer.step()
        print(f"step {step}  loss: {args.world} DDP ranks on flce ({args.recipe}) "
              f"{ddp['losses'][step]:.6f}, "
              f"one process on torch {total:.6f}", flush=True)
    drift = max(float((ddp["state"][name] - p).abs().max())
                for name, p in model.state_dict().items())
    print(f"largest parameter difference after {args.steps} steps: {drift:.2e}")
    print("OK" if drift < 1e-5 else "DIFFERENT")
    return drift


if __name__ == "__main__":
    sys.exit(0 if main() < 1e-5 else 1)
