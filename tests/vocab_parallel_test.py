"""flce.vocab_parallel in a torch.distributed job: 2 and 3 gloo ranks on the
CPU, each with its own client and a vocabulary shard of W (uneven), against
a real flce_server (the CPU backend, or $FLCE_TEST_BACKEND): the loss and
every gradient (dX on every rank, each rank's dW and db rows) equal the
unsharded computation, an fp64 reference and the one-process flce module,
for both backward modes, every reduction and every option together.

Run by Bazel (tests/BUILD) with the path of flce_server as the argument.
"""

import os
import socket
import sys
import tempfile
import unittest

import torch
import torch.distributed as dist
import torch.nn.functional as F

import flce
from flce.vocab_parallel import VocabParallelCrossEntropy
from server_process import ServerProcess, run_tests

SERVER = sys.argv[1] if len(sys.argv) > 1 else ""
N, H, V = 23, 16, 101

# (name, dtype, reduction, mode, every option)
CONFIGS = [
    ("plain mean, store_grads", torch.float32, "mean", "store_grads", False),
    ("plain mean, recompute", torch.float32, "mean", "recompute", False),
    ("every option, mean, store_grads", torch.float32, "mean", "store_grads", True),
    ("every option, sum, recompute", torch.float32, "sum", "recompute", True),
    ("every option, none, store_grads", torch.float32, "none", "store_grads", True),
    ("every option, none, recompute", torch.float32, "none", "recompute", True),
    ("every option, mean, bf16", torch.bfloat16, "mean", "auto", True),
]


def problem(config):
    """The whole problem, the same on every rank (seeded by the config)."""
    name, dtype, reduction, _, every = config
    gen = torch.Generator().manual_seed(sum(map(ord, name)))  # the same in every process
    x = torch.randn(N, H, generator=gen).to(dtype)
    w = (torch.randn(V, H, generator=gen) / 3).to(dtype)
    t = torch.randint(0, V, (N,), generator=gen)
    options = {"reduction": reduction}
    b = None
    if every:
        b = torch.randn(V, generator=gen).to(dtype)
        t[::4] = 7  # ignore_index below
        options.update(ignore_index=7, label_smoothing=0.1, logit_softcap=4.0,
                       z_loss_scale=1e-2,
                       class_weight=torch.rand(V, generator=gen) * 1.5 + 0.25)
    g = (torch.rand(N, generator=gen) + 0.5) if reduction == "none" else torch.tensor(0.75)
    return x, w, b, t, options, g


def shard_bounds(world):
    """Uneven vocabulary shards: each rank's [first, last)."""
    cuts = [0] + [V * (k + 1) // world + (3 if k % 2 else -2) for k in range(world - 1)] + [V]
    return [(cuts[k], cuts[k + 1]) for k in range(world)]


def worker(rank, world, port, server, out_dir):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    client = flce.Client(server)
    first, last = shard_bounds(world)[rank]
    for k, config in enumerate(CONFIGS):
        x, w, b, t, options, g = problem(config)
        x.requires_grad_()
        w_shard = w[first:last].clone().requires_grad_()
        b_shard = None if b is None else b[first:last].clone().requires_grad_()
        module = VocabParallelCrossEntropy(client, first, V, backward_mode=config[3], **options)
        loss = module(x, w_shard, t, b_shard)
        (loss * g).sum().backward()
        torch.save({"loss": loss.detach(), "dx": x.grad,
                    "dw": w_shard.grad, "db": None if b_shard is None else b_shard.grad},
                   os.path.join(out_dir, f"{k}-{rank}.pt"))
    client.close()
    dist.destroy_process_group()


def reference(config):
    """fp64 PyTorch: the loss and the gradients of (loss · g)."""
    x, w, b, t, options, g = problem(config)
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_()
    b64 = None if b is None else b.double().requires_grad_()
    z = F.linear(x64, w64, b64)
    cap = options.get("logit_softcap")
    if cap:
        z = cap * torch.tanh(z / cap)
    ignore = options.get("ignore_index", -100)
    cw = options.get("class_weight")
    rows = F.cross_entropy(z, t, weight=None if cw is None else cw.double(), ignore_index=ignore,
                           reduction="none", label_smoothing=options.get("label_smoothing", 0.0))
    lse = torch.logsumexp(z, dim=1)
    valid = t != ignore
    rows = rows + torch.where(valid, options.get("z_loss_scale", 0.0) * lse * lse,
                              torch.zeros_like(lse))
    if options["reduction"] == "none":
        loss = rows
    elif options["reduction"] == "sum":
        loss = rows.sum()
    else:
        w_t = cw.double()[torch.where(valid, t, 0)] if cw is not None else torch.ones_like(lse)
        loss = rows.sum() / torch.where(valid, w_t, torch.zeros_like(w_t)).sum()
    (loss * g.double()).sum().backward()
    return loss.detach(), x64.grad, w64.grad, None if b64 is None else b64.grad


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


class VocabParallelTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = ServerProcess(SERVER, "--backend=" + os.environ.get("FLCE_TEST_BACKEND",
                                                                         "cpu"))

    @classmethod
    def tearDownClass(cls):
        cls.server.kill()

    def one_process(self, config):
        """The same problem through the one-process module (the whole W)."""
        x, w, b, t, options, g = problem(config)
        x.requires_grad_()
        w.requires_grad_()
        if b is not None:
            b.requires_grad_()
        module = flce.RemoteLinearCrossEntropy(self.server.address, register_weight=False,
                                               backward_mode="recompute"
                                               if options["reduction"] == "none" else config[3],
                                               **options)
        self.addCleanup(module.close)
        loss = module(x, w, t, b)
        (loss * g).sum().backward()
        return loss.detach(), x.grad, w.grad, None if b is None else b.grad

    def test_shards_over_ranks_equal_the_whole(self):
        for world in (2, 3):
            out_dir = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            torch.multiprocessing.spawn(worker, args=(world, port, self.server.address, out_dir),
                                        nprocs=world)
            bounds = shard_bounds(world)
            for k, config in enumerate(CONFIGS):
                with self.subTest(world=world, config=config[0]):
                    parts = [torch.load(os.path.join(out_dir, f"{k}-{r}.pt")) for r in range(world)]
                    loss = parts[0]["loss"]
                    for p in parts[1:]:  # the same loss and dX on every rank
                        self.assertTrue(torch.equal(p["loss"], loss))
                        self.assertTrue(torch.equal(p["dx"], parts[0]["dx"]))
                    dw = torch.cat([p["dw"] for p in parts])
                    db = None if parts[0]["db"] is None else torch.cat([p["db"] for p in parts])
                    self.assertEqual([p["dw"].shape[0] for p in parts],
                                     [last - first for first, last in bounds])
                    got = (loss, parts[0]["dx"], dw, db)
                    bar = 1e-5 if config[1] == torch.float32 else 1e-2
                    for name, a, want in zip(("loss", "dx", "dw", "db"), got, reference(config)):
                        if want is not None:
                            self.assertLess(rel(a, want), max(bar, 1e-5), (name, "fp64"))
                    for name, a, want in zip(("loss", "dx", "dw", "db"), got,
                                             self.one_process(config)):
                        if want is not None:
                            self.assertLess(rel(a, want), bar, (name, "one process"))


if __name__ == "__main__":
    sys.exit(run_tests(VocabParallelTest, "VocabParallelTest"))
