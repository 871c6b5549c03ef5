"""Trains a tiny language model whose LM-head loss runs on an flce server.

    bazel build //client/python:flce_pb
    PYTHONPATH=client/python:bazel-bin/client/python \\
        python3 client/python/examples/train_tiny_lm.py --server=localhost:50051

The model, optimizer and data stay in this process (and on its device); only
the last step — cross_entropy(hidden @ head.weightᵀ + head.bias, targets) and
its gradients — goes to flce. Gradient accumulation works as with any loss.
"""

import argparse
import sys

import torch

import flce


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.mix = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Linear(hidden, vocab)

    def hidden_states(self, tokens):
        return torch.tanh(self.mix(self.embed(tokens)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="localhost:50051")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro_batches", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
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
    # Synthetic "language": each token is followed by (7 × token + 3) mod V.
    losses = []
    for step in range(args.steps):
        optimizer.zero_grad()
        total = 0.0
        for _ in range(args.micro_batches):
            tokens = torch.randint(0, args.vocab, (8, 32), device=args.device)
            targets = (7 * tokens + 3) % args.vocab
            hidden = model.hidden_states(tokens)
            loss = loss_fn(hidden, model.head.weight, targets, model.head.bias)
            (loss / args.micro_batches).backward()
            total += float(loss) / args.micro_batches
        optimizer.step()
        losses.append(total)
        print(f"step {step:3d}  loss {total:.4f}", flush=True)
    return losses


if __name__ == "__main__":
    losses = main()
    sys.exit(0 if losses[-1] < losses[0] else 1)
