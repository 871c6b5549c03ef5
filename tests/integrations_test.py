"""flce.integrations.transformers and torch.compile against a real flce_server
(the CPU backend, or $FLCE_TEST_BACKEND).

- Everywhere (plain torch): HF's label shift and normaliser — the loss and
  every gradient equal F.cross_entropy over the shifted labels, with -100,
  with num_items_in_batch, and over all-ignored batches.
- Where transformers is installed (the GPU machine; $REQUIRE_TRANSFORMERS=1
  makes its absence a failure): for Llama, Mistral, Qwen2, Qwen3, Gemma 2
  (softcap) and Phi-3, small random configs train a few optimizer steps with
  gradient accumulation patched and unpatched: losses and parameters equal
  to fp32 rounding; tied embeddings; logits only when asked; a Trainer run.
- Where torch.compile exists (torch >= 2.0): a compiled model with the
  module trains like the eager one, ignored targets included.

Prints each comparison's largest differences (bench/RESULTS.md records the
GPU machine's). Run by Bazel (tests/BUILD) with the path of flce_server.
"""

import copy
import os
import sys
import unittest

import torch
import torch.nn.functional as F

import flce
from flce.integrations.transformers import (apply_flce, causal_lm_loss, remove_flce,
                                            shifted_labels)
from server_process import ServerProcess, run_tests

SERVER = sys.argv[1]
DEVICE = "cuda" if os.environ.get("FLCE_TEST_BACKEND") == "cuda" else "cpu"

try:
    import transformers
except ImportError:
    transformers = None


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


class WithServer(unittest.TestCase):
    """A server and a client for the test class."""

    @classmethod
    def setUpClass(cls):
        cls.server = ServerProcess(SERVER, "--backend=" + os.environ.get("FLCE_TEST_BACKEND",
                                                                         "cpu"))
        cls.client = flce.Client(cls.server.address)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.kill()


class IntegrationsTest(WithServer):
    def loss_fn(self, **options):
        m = flce.RemoteLinearCrossEntropy(self.client, reduction="sum", register_weight=False,
                                          **options)
        self.addCleanup(m.close)
        return m

    def test_the_shift_and_the_normaliser_are_hfs(self):
        torch.manual_seed(0)
        b, t, h, v = 3, 11, 16, 97
        labels = torch.randint(0, v, (b, t))
        labels[0, :4] = -100  # a prompt's tokens
        labels[2, 7] = -100
        self.assertEqual(shifted_labels(labels)[:, -1].tolist(), [-100] * b)
        self.assertTrue(torch.equal(shifted_labels(labels)[:, :-1], labels[:, 1:]))
        m = self.loss_fn()
        for num_items in (None, 40, torch.tensor(29)):
            hidden = torch.randn(b, t, h, dtype=torch.float64).float().requires_grad_()
            weight = (torch.randn(v, h) / 4).requires_grad_()
            loss = causal_lm_loss(m, hidden, weight, labels, num_items_in_batch=num_items)
            loss.backward()
            h_ref = hidden.detach().clone().requires_grad_()
            w_ref = weight.detach().clone().requires_grad_()
            logits = F.linear(h_ref[:, :-1], w_ref).reshape(-1, v)
            target = labels[:, 1:].reshape(-1)
            if num_items is None:
                ref = F.cross_entropy(logits, target)
            else:
                ref = F.cross_entropy(logits, target, reduction="sum") / num_items
            ref.backward()
            self.assertLess(rel(loss, ref), 1e-5, num_items)
            self.assertLess(rel(hidden.grad, h_ref.grad), 1e-5, num_items)
            self.assertLess(rel(weight.grad, w_ref.grad), 1e-5, num_items)
        # Already-shifted labels (HF's shift_labels) and a batch with nothing
        # to learn from: NaN, as F.cross_entropy's mean gives.
        hidden = torch.randn(2, 5, h)
        weight = torch.randn(v, h)
        ignored = torch.full((2, 5), -100)
        self.assertTrue(torch.isnan(causal_lm_loss(m, hidden, weight, ignored)))
        shifted = shifted_labels(torch.randint(0, v, (2, 5)))
        self.assertLess(rel(causal_lm_loss(m, hidden, weight, shift_labels=shifted),
                            F.cross_entropy(F.linear(hidden, weight).reshape(-1, v),
                                            shifted.reshape(-1))), 1e-5)
        with self.assertRaises(ValueError):
            causal_lm_loss(flce.RemoteLinearCrossEntropy(self.client), hidden, weight, ignored)

    def test_a_model_holding_the_module_deep_copies(self):
        # (EMA copies, ref/policy pairs): the copy's module shares the client
        # and has its own registration; both compute the same loss.
        model = torch.nn.Module()
        model.head = torch.nn.Linear(8, 50, bias=False)
        model.loss_fn = flce.RemoteLinearCrossEntropy(self.client, label_smoothing=0.1)
        self.addCleanup(model.loss_fn.close)
        twin = copy.deepcopy(model)
        self.addCleanup(twin.loss_fn.close)
        self.assertIs(twin.loss_fn.client, model.loss_fn.client)
        self.assertEqual(twin.loss_fn.label_smoothing, 0.1)
        self.assertIsNot(twin.loss_fn._registration, model.loss_fn._registration)
        x, t = torch.randn(5, 8), torch.randint(0, 50, (5,))
        with torch.no_grad():
            self.assertEqual(float(model.loss_fn(x, model.head.weight, t)),
                             float(twin.loss_fn(x, twin.head.weight, t)))

    @unittest.skipIf(not hasattr(torch, "compile"), "torch.compile needs torch >= 2.0")
    def test_a_compiled_model_trains_like_the_eager_one(self):
        torch.manual_seed(1)
        v, h = 61, 24

        class TinyLM(torch.nn.Module):
            def __init__(self, loss_fn):
                super().__init__()
                self.embed = torch.nn.Embedding(v, h)
                self.mix = torch.nn.Linear(h, h)
                self.head = torch.nn.Linear(h, v, bias=False)
                self.loss_fn = loss_fn

            def forward(self, tokens, targets):
                x = torch.tanh(self.mix(self.embed(tokens)))
                return self.loss_fn(x.reshape(-1, h), self.head.weight, targets.reshape(-1))

        eager = TinyLM(flce.RemoteLinearCrossEntropy(self.client, register_weight=False)).to(DEVICE)
        compiled_model = copy.deepcopy(eager)  # its own loss module, on the same client
        self.assertIsNot(compiled_model.loss_fn, eager.loss_fn)
        self.assertIs(compiled_model.loss_fn.client, eager.loss_fn.client)
        compiled = torch.compile(compiled_model)
        opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (eager, compiled_model)]
        gen = torch.Generator().manual_seed(2)
        worst = 0.0
        for step in range(4):
            tokens = torch.randint(0, v, (4, 9), generator=gen).to(DEVICE)
            targets = torch.randint(0, v, (4, 9), generator=gen).to(DEVICE)
            targets[:, :3] = -100  # ignored targets in every batch
            losses = []
            for model, opt in zip((eager, compiled), opts):
                opt.zero_grad()
                loss = model(tokens, targets)
                loss.backward()
                opt.step()
                losses.append(loss.detach())
            worst = max(worst, rel(losses[1], losses[0]))
            self.assertLess(rel(losses[1], losses[0]), 1e-5, step)
        for (name, a), (_, b) in zip(eager.named_parameters(), compiled_model.named_parameters()):
            self.assertLess(rel(b, a), 1e-5, name)
        print(f"\ntorch.compile: largest relative loss difference {worst:.2e}")


@unittest.skipIf(transformers is None and not os.environ.get("REQUIRE_TRANSFORMERS"),
                 "transformers is not installed (the GPU machine runs these)")
class TransformersTest(WithServer):
    def model(self, arch, tie=False):
        from hf_trainer import CONFIGS  # the example's architectures

        config_name, model_name, extra = CONFIGS[arch]
        config = getattr(transformers, config_name)(
            vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            tie_word_embeddings=tie, attn_implementation="eager", **extra)
        torch.manual_seed(5)
        return getattr(transformers, model_name)(config).to(DEVICE)

    def batch(self, gen, b=3, t=17):
        ids = torch.randint(0, 301, (b, t), generator=gen)
        labels = ids.clone()
        labels[:, :5] = -100  # the prompt
        return ids.to(DEVICE), labels.to(DEVICE)

    def train_both(self, arch, tie=False, steps=3, accumulate=2):
        ref = self.model(arch, tie)
        patched = copy.deepcopy(ref)
        loss_fn = apply_flce(patched, self.client)
        self.addCleanup(loss_fn.close)
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ref, patched)]
        gen = torch.Generator().manual_seed(7)
        worst_loss = 0.0
        for _ in range(steps):
            for opt in opts:
                opt.zero_grad()
            batches = [self.batch(gen) for _ in range(accumulate)]
            items = sum(int((shifted_labels(labels) != -100).sum()) for _, labels in batches)
            for ids, labels in batches:
                losses = []
                for model in (ref, patched):
                    out = model(ids, labels=labels, num_items_in_batch=items)
                    out.loss.backward()
                    losses.append(out.loss.detach())
                worst_loss = max(worst_loss, abs(float(losses[1] - losses[0])))
                self.assertLess(rel(losses[1], losses[0]), 1e-5, arch)
            for opt in opts:
                opt.step()
        drift = max(float((a - b).abs().max()) for a, b in zip(ref.parameters(),
                                                                patched.parameters()))
        print(f"\n{arch}{' tied' if tie else ''}: {steps} steps x {accumulate} micro-batches, "
              f"largest loss difference {worst_loss:.2e}, largest parameter drift {drift:.2e}")
        self.assertLess(drift, 1e-5, arch)
        return ref, patched

    def test_each_architecture_trains_like_the_unpatched_model(self):
        from hf_trainer import CONFIGS

        for arch in CONFIGS:
            with self.subTest(arch=arch):
                self.train_both(arch)

    def test_tied_embeddings_and_logits_only_when_asked(self):
        ref, patched = self.train_both("llama", tie=True)
        self.assertIs(patched.lm_head.weight, patched.model.embed_tokens.weight)
        ids, labels = self.batch(torch.Generator().manual_seed(9))
        with torch.no_grad():
            out = patched(ids, labels=labels)
            self.assertIsNone(out.logits)
            logits = patched(ids).logits  # no labels: logits, as before
            self.assertLess(rel(logits, ref(ids).logits), 1e-5)
            self.assertEqual(patched(ids, logits_to_keep=1).logits.shape[1], 1)
        remove_flce(patched)
        with torch.no_grad():
            self.assertIsNotNone(patched(ids, labels=labels).logits)

    def test_gemma2s_softcap_is_flces(self):
        patched = self.model("gemma2")
        loss_fn = apply_flce(patched, self.client, return_logits=True)
        self.addCleanup(loss_fn.close)
        self.assertEqual(loss_fn.logit_softcap, 5.0)
        ids, labels = self.batch(torch.Generator().manual_seed(3))
        with torch.no_grad():
            out = patched(ids, labels=labels)
            # The logits asked for are softcapped; the loss equals the one
            # computed from them.
            self.assertLessEqual(float(out.logits.abs().max()), 5.0)
            ref = F.cross_entropy(out.logits.reshape(-1, 301).float(),
                                  shifted_labels(labels).reshape(-1))
            self.assertLess(rel(out.loss, ref), 1e-5)

    def test_a_trainer_run_equals_the_unpatched_one(self):
        import tempfile

        def run(patch):
            model = self.model("qwen2")
            if patch:
                self.addCleanup(apply_flce(model, self.client).close)
            gen = torch.Generator().manual_seed(11)
            rows = []
            for _ in range(8):
                ids, labels = self.batch(gen, b=1)
                rows.append({"input_ids": ids[0].cpu(), "labels": labels[0].cpu()})
            args = transformers.TrainingArguments(
                output_dir=tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR")), max_steps=3,
                per_device_train_batch_size=2, gradient_accumulation_steps=2,
                learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no",
                use_cpu=DEVICE == "cpu", seed=0, data_seed=0, dataloader_num_workers=0)
            trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)
            trainer.train()
            return [h["loss"] for h in trainer.state.log_history if "loss" in h], model

        (ref_losses, ref), (losses, patched) = run(False), run(True)
        self.assertEqual(len(losses), 3)
        for a, b in zip(ref_losses, losses):
            self.assertAlmostEqual(a, b, places=4)
        drift = max(float((a - b).abs().max()) for a, b in zip(ref.parameters(),
                                                                patched.parameters()))
        print(f"\nTrainer (qwen2, 3 steps, accumulation 2): losses {losses} against "
              f"{ref_losses}, largest parameter drift {drift:.2e}")
        self.assertLess(drift, 1e-5)


if __name__ == "__main__":
    sys.exit(run_tests([IntegrationsTest, TransformersTest], "IntegrationsTest"))
