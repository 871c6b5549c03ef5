"""Trains a tiny language model whose LM-head loss runs on an flce server.

    pip install flce-<version>-py3-none-any.whl      # tools/build_wheel.sh makes it
    python3 client/python/examples/train_tiny_lm.py --server=localhost:50051 [--compare]

The model, optimizer and data stay in this process (and on its device); only
the last step — cross_entropy(hidden @ head.weightᵀ + head.bias, targets) and
its gradients — goes to flce. Gradient accumulation works as with any loss.
Prints each optimizer step's loss ("step   0  loss 6.9088"); with
``--compare`` it also trains a copy of the model with PyTorch's own loss on
the same data and prints that copy's loss and the largest difference of any
parameter so far ("torch 6.9088  max |Δparam| 2.4e-08"), ending with "OK"
when the two stayed equal to fp32 rounding. Exits 0 when the loss fell (and,
with --compare, the runs agreed).
"""

import argparse
import copy
import sys

import torch
import torch.nn.functional as F

import flce


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.mix = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Linear(hidden, vocab)

    def hidden_states(self, tokens):
        return torch.tanh(self.mix(self.embed(tokens)))

    forward = hidden_states  # the loss (flce's, or PyTorch's) takes it from here


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="localhost:50051")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro_batches", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compare", action="store_true",
                        help="also train a copy with PyTorch's loss and compare (fp32)")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    model = TinyLM(args.vocab, args.hidden).to(device=args.device, dtype=dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loss_fn = flce.RemoteLinearCrossEntropy(args.server, label_smoothing=0.05)
    # The head's weight is registered with the server (sent again only after
    # a step changed it) and its gradients summed there; they land in .grad
    # before each optimizer step.
    loss_fn.attach(optimizer)
    twin = copy.deepcopy(model) if args.compare else None
    twin_optimizer = torch.optim.AdamW(twin.parameters(), lr=3e-3) if args.compare else None
    # Synthetic "language": each token is followed by (7 × token + 3) mod V.
    losses, drift = [], 0.0
    for step in range(args.steps):
        optimizer.zero_grad()
        total = twin_total = 0.0
        if twin is not None:
            twin_optimizer.zero_grad()
        for _ in range(args.micro_batches):
            tokens = torch.randint(0, args.vocab, (8, 32), device=args.device)
            targets = (7 * tokens + 3) % args.vocab
            hidden = model.hidden_states(tokens)
            loss = loss_fn(hidden, model.head.weight, targets, model.head.bias)
            (loss / args.micro_batches).backward()
            total += float(loss.detach()) / args.micro_batches
            if twin is not None:
                logits = F.linear(twin.hidden_states(tokens), twin.head.weight, twin.head.bias)
                ref = F.cross_entropy(logits.float().reshape(-1, args.vocab), targets.reshape(-1),
                                      label_smoothing=0.05)
                (ref / args.micro_batches).backward()
                twin_total += float(ref.detach()) / args.micro_batches
        optimizer.step()
        losses.append(total)
        line = f"step {step:3d}  loss {total:.4f}"
        if twin is not None:
            twin_optimizer.step()
            drift = max(drift, max(float((a - b).detach().abs().max())
                                   for a, b in zip(model.parameters(), twin.parameters())))
            line += f"  torch {twin_total:.4f}  max |Δparam| {drift:.1e}"
        print(line, flush=True)
    if twin is not None:
        print("OK" if drift < 1e-4 else "DIFFERENT")
    return losses if twin is None else (losses, drift)


if __name__ == "__main__":
    result = main()
    losses, drift = result if isinstance(result, tuple) else (result, 0.0)
    sys.exit(0 if losses[-1] < losses[0] and drift < 1e-4 else 1)
