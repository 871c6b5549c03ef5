"""The remote drop-in's steps in row pieces (flce/row_pipeline.py) against a
real flce_server (the CPU backend, or $FLCE_TEST_BACKEND): equal to local PyTorch and to one call step for
step (gradient accumulation included, the first step on the exact path),
every session released, errors clean, and the cases that take one call.

Run by Bazel (tests/BUILD) with the path of flce_server as the argument.
"""

import gc
import os
import sys
import time
import unittest

import grpc
import torch
import torch.nn.functional as F

import flce
from flce.row_pipeline import PipelinedStep
from server_process import ServerProcess, run_tests, wait_for

SERVER = sys.argv[1]


class RowPipelineTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        # CPU in CI; the GPU machine runs it against --backend=cuda too.
        backend = os.environ.get("FLCE_TEST_BACKEND", "cpu")
        cls.server = ServerProcess(SERVER, "--backend=" + backend)

    @classmethod
    def tearDownClass(cls):
        cls.server.kill()

    def module(self, pieces=3, min_piece_bytes=1 << 10, **options):
        client = flce.Client(self.server.address, bulk_connections=2, bulk_threshold=1 << 10)
        self.addCleanup(client.close)
        m = flce.RemoteLinearCrossEntropy(client, pipeline_pieces=pieces,
                                          pipeline_min_piece_bytes=min_piece_bytes, **options)
        self.addCleanup(m.close)
        return m

    def live_sessions(self, client):
        # Releases of dropped sessions go out without waiting for an answer.
        deadline = time.monotonic() + 5
        while True:
            live = client.stats().live_sessions
            if live == 0 or time.monotonic() > deadline:
                return live
            time.sleep(0.02)

    def train(self, m, dtype, steps=4, accumulate=2, device="cpu", **torch_options):
        """Steps of gradient accumulation through `m` and locally; returns
        the largest differences of the losses, dX and dW."""
        torch.manual_seed(3)
        n, h, v = 211, 48, 997
        w = (torch.randn(v, h) / 7).to(device=device, dtype=dtype).requires_grad_()
        w_ref = w.detach().clone().requires_grad_()
        worst = [0.0, 0.0, 0.0]
        for _ in range(steps):
            for _ in range(accumulate):
                x = torch.randn(n, h).to(device=device, dtype=dtype).requires_grad_()
                x_ref = x.detach().clone().requires_grad_()
                t = torch.randint(0, v, (n,)).to(device)
                t[::5] = -100
                loss = m(x, w, t) / accumulate
                loss.backward()
                self.assertIsInstance(m._last, PipelinedStep)
                ref = F.cross_entropy(F.linear(x_ref.float(), w_ref.float()), t,
                                      **torch_options) / accumulate
                ref.backward()
                worst[0] = max(worst[0], abs(float(loss.detach()) - float(ref.detach())))
                worst[1] = max(worst[1], float((x.grad.float() - x_ref.grad).abs().max()))
            m.pull_weight_grads()
            worst[2] = max(worst[2], float((w.grad.float() - w_ref.grad.float()).abs().max()))
            with torch.no_grad():  # an optimizer step: the weight is put again
                w -= 0.1 * w.grad
                w_ref -= 0.1 * w_ref.grad
            w.grad = None
            w_ref.grad = None
        return worst

    def test_pieces_equal_local_torch_step_for_step(self):
        cw = torch.rand(997) + 0.5
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
            for options in ({}, {"label_smoothing": 0.1, "class_weight": cw},
                            {"reduction": "sum"}):
                with self.subTest(dtype=dtype, options=sorted(options)):
                    m = self.module(**options)
                    torch_options = {"label_smoothing": options.get("label_smoothing", 0.0),
                                     "weight": options.get("class_weight"),
                                     "reduction": options.get("reduction", "mean")}
                    loss, dx, dw = self.train(m, dtype, **torch_options)
                    scale = 100.0 if options.get("reduction") == "sum" else 1.0
                    self.assertLess(loss, tol * scale)
                    self.assertLess(dx, tol)
                    self.assertLess(dw, tol * scale)
                    self.assertEqual(self.live_sessions(m.client), 0)

    def test_a_batch_too_small_for_two_pieces_goes_in_one_over_the_bulk_port(self):
        # X of 211×48 fp32 (40 KiB) above the client's bulk threshold (1 KiB)
        # but under two pieces of 1 MiB: one piece through the region.
        m = self.module(min_piece_bytes=1 << 20)
        loss, dx, dw = self.train(m, torch.float32)
        self.assertEqual(len(m._last.sessions), 1)
        self.assertLess(loss, 1e-5)
        self.assertLess(dx, 1e-5)
        self.assertLess(dw, 1e-5)
        self.assertEqual(self.live_sessions(m.client), 0)

    def test_each_pieces_dx_read_goes_out_with_its_forward(self):
        # Marks: each piece's read waits at the server for its Forward's
        # post (after_mark on the read's access line), none after the answer
        # (the one plain read: the pull of the weight's gradient).
        m = self.module()
        transfer = m.client.bulk(1 << 20)
        transfer.region(1 << 20)
        calls = {"marked": 0, "after": 0}
        marked, plain = transfer.read_marked, transfer.read
        transfer.read_marked = lambda *a: (calls.__setitem__("marked", calls["marked"] + 1),
                                           marked(*a))[1]
        transfer.read = lambda *a: (calls.__setitem__("after", calls["after"] + 1), plain(*a))[1]
        before = self.server.read_log().count("after_mark=")
        loss, dx, dw = self.train(m, torch.float32, steps=1, accumulate=1)
        self.assertLess(max(loss, dx, dw), 1e-5)
        self.assertEqual(calls, {"marked": 3, "after": 1})  # and the pull of dW
        deadline = time.monotonic() + 5
        while (self.server.read_log().count("after_mark=") - before < 3
               and time.monotonic() < deadline):
            time.sleep(0.02)
        self.assertGreaterEqual(self.server.read_log().count("after_mark=") - before, 3)
        # A server without marks (older): dX read after each answer.
        transfer.marks = False
        calls.update(marked=0, after=0)
        loss, dx, dw = self.train(m, torch.float32, steps=1, accumulate=1)
        self.assertLess(max(loss, dx, dw), 1e-5)
        self.assertEqual(calls, {"marked": 0, "after": 3 + 1})
        self.assertEqual(self.live_sessions(m.client), 0)

    def test_the_backwards_adds_go_out_behind_the_next_steps_pieces(self):
        # With the expected upstream gradient, backward sends nothing: each
        # piece's GRADIENTS_WEIGHT add goes once the next step's Forwards
        # are out, or before the pull reads the sum; the sum is the same.
        torch.manual_seed(5)
        n, h, v = 211, 48, 997
        m = self.module()
        m._registration.SEND_AFTER_S = 60  # (see the test after this one)
        w = (torch.randn(v, h) / 7).requires_grad_()
        w_ref = w.detach().clone().requires_grad_()

        def backwards():
            stats = m.client.stats()
            return sum(r.count for r in stats.requests if r.rpc == "Backward")

        base = backwards()
        for step in range(3):
            x = torch.randn(n, h).requires_grad_()
            t = torch.randint(0, v, (n,))
            m(x, w, t).backward()
            F.cross_entropy(F.linear(x.detach(), w_ref), t).backward()
            # Each step's 3 adds go behind the next step's pieces (upstream
            # 1 is the one expected from the start).
            sent = base + 3 * step
            wait_for(lambda: backwards() == sent, f"step {step}'s Backwards")
            time.sleep(0.1)
            self.assertEqual(backwards(), sent)  # this step's adds: not yet
        m.pull_weight_grads()
        self.assertEqual(backwards(), base + 3 * 3)
        self.assertLess(float((w.grad - w_ref.grad).abs().max()), 1e-5)
        self.assertEqual(self.live_sessions(m.client), 0)

    def test_deferred_adds_go_by_themselves_when_no_step_comes(self):
        # No next step and no pull: the adds go after SEND_AFTER_S (50 ms),
        # their sessions released by them, and the pull finds them done.
        torch.manual_seed(7)
        m = self.module()
        w = (torch.randn(997, 48) / 7).requires_grad_()
        x = torch.randn(211, 48).requires_grad_()
        t = torch.randint(0, 997, (211,))
        m(x, w, t).backward()
        self.assertEqual(self.live_sessions(m.client), 0)  # consumed by their adds
        self.assertEqual(m._registration._deferred, [])
        m.pull_weight_grads()
        w_ref = w.detach().clone().requires_grad_()
        F.cross_entropy(F.linear(x.detach(), w_ref), t).backward()
        self.assertLess(float((w.grad - w_ref.grad).abs().max()), 1e-5)

    def test_a_deferred_add_that_fails_fails_the_pull(self):
        # The pieces' sessions gone before their adds went out: the pull
        # sends them, and raises their error instead of a sum without them.
        torch.manual_seed(6)
        m = self.module()
        m._registration.SEND_AFTER_S = 60  # nothing sent before the pull
        w = (torch.randn(997, 48) / 7).requires_grad_()
        x = torch.randn(211, 48).requires_grad_()
        m(x, w, torch.randint(0, 997, (211,))).backward()
        for session_id in m._last.sessions:
            m.client.release_session(session_id)
        with self.assertRaises(flce.FlceError) as e:
            m.pull_weight_grads()
        # (A released session: FAILED_PRECONDITION, as for any Backward.)
        self.assertEqual(e.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
        self.assertIsNone(w.grad)
        # The module serves on: the next step and its pull.
        x = torch.randn(211, 48).requires_grad_()
        t = torch.randint(0, 997, (211,))
        m(x, w, t).backward()
        m.pull_weight_grads()
        w_ref = w.detach().clone().requires_grad_()
        F.cross_entropy(F.linear(x.detach(), w_ref), t).backward()
        self.assertLess(float((w.grad - w_ref.grad).abs().max()), 1e-5)
        self.assertEqual(self.live_sessions(m.client), 0)

    def test_evaluation_sends_x_over_the_bulk_port(self):
        # No gradient: one Forward without a session, its X (above the
        # client's 1 KiB bulk threshold) written into the region first.
        m = self.module(label_smoothing=0.1)
        torch.manual_seed(7)
        w = torch.randn(997, 48) / 7
        x = torch.randn(211, 48)
        t = torch.randint(0, 997, (211,))
        transfer = m.client.bulk(x.numel() * 4)
        writes = []
        original = transfer.write
        transfer.write = lambda *args: (writes.append(args[2]), original(*args))[1]
        with torch.no_grad():
            loss = m(x, w, t)
        ref = F.cross_entropy(F.linear(x, w), t, label_smoothing=0.1)
        self.assertAlmostEqual(float(loss), float(ref), places=5)
        # The weight's registration (put once), then X.
        self.assertEqual([len(memoryview(b).cast("B")) for b in writes],
                         [w.numel() * 4, x.numel() * 4])
        self.assertEqual(m.client.stats().live_sessions, 0)
        # A batch under the threshold goes in the message.
        writes.clear()
        with torch.no_grad():
            m(x[:4], w, t[:4])
        self.assertEqual(writes, [])

    @unittest.skipUnless(torch.cuda.is_available(), "needs a GPU (the GPU machine runs it)")
    def test_gpu_tensors_go_through_pinned_buffers_and_equal_local_torch(self):
        # The pieces staged through pinned host memory on a side stream, dX
        # copied back on it and waited for by the caller's stream; the
        # first step on the exact path, the rest on the fast one.
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
            with self.subTest(dtype=dtype):
                m = self.module()
                loss, dx, dw = self.train(m, dtype, device="cuda")
                self.assertLess(loss, tol)
                self.assertLess(dx, tol)
                self.assertLess(dw, tol)
                self.assertEqual(self.live_sessions(m.client), 0)

    def test_pieces_equal_one_call_with_every_option(self):
        options = dict(label_smoothing=0.05, logit_softcap=12.0, z_loss_scale=1e-3,
                       class_weight=torch.rand(997) + 0.5)
        torch.manual_seed(5)
        w = (torch.randn(997, 48) / 7).requires_grad_()
        x = torch.randn(211, 48)
        t = torch.randint(0, 997, (211,))
        t[::4] = -100
        results = []
        for pieces in (1, 4):
            m = self.module(pieces=pieces, **options)
            for g in (0.5, 0.5, 2.0):  # the exact path, the fast one, the exact one again
                xi = x.clone().requires_grad_()
                loss = m(xi, w, t)
                (loss * g).backward()
                results.append((pieces, g, float(loss), float(m.last_z_loss), xi.grad.clone()))
            m.pull_weight_grads()
            results.append((pieces, "dw", w.grad.clone()))
            w.grad = None
        one, four = results[:4], results[4:]
        for a, b in zip(one[:3], four[:3]):
            self.assertAlmostEqual(a[2], b[2], places=5)
            self.assertAlmostEqual(a[3], b[3], places=6)
            torch.testing.assert_close(a[4], b[4], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(one[3][2], four[3][2], rtol=1e-5, atol=1e-7)

    def test_a_loss_dropped_without_backward_releases_every_piece(self):
        m = self.module()
        w = torch.randn(997, 48, requires_grad=True)
        loss = m(torch.randn(211, 48, requires_grad=True), w, torch.randint(0, 997, (211,)))
        self.assertIsInstance(m._last, PipelinedStep)
        self.assertEqual(m.client.stats().live_sessions, 3)
        del loss
        m._last = None
        gc.collect()
        m.client._flush_releases()
        self.assertEqual(self.live_sessions(m.client), 0)

    def test_a_bad_piece_fails_the_step_and_leaves_no_session(self):
        m = self.module(class_weight=torch.rand(997))
        w = torch.randn(997, 48, requires_grad=True)
        t = torch.randint(0, 997, (211,))
        t[200] = 5000  # in the last piece
        with self.assertRaises(flce.FlceError) as e:
            m(torch.randn(211, 48, requires_grad=True), w, t)
        self.assertEqual(e.exception.code, grpc.StatusCode.OUT_OF_RANGE)
        self.assertIn("5000", e.exception.details)
        self.assertEqual(self.live_sessions(m.client), 0)
        # The module still serves.
        t[200] = 5
        m(torch.randn(211, 48, requires_grad=True), w, t).backward()

    def test_the_cases_that_take_one_call(self):
        w = torch.randn(997, 48, requires_grad=True)
        x = torch.randn(211, 48, requires_grad=True)
        t = torch.randint(0, 997, (211,))
        # reduction none, evaluation, retain_graph, every row ignored.
        cases = [(self.module(reduction="none"), t, True),
                 (self.module(), t, False),
                 (self.module(retain_graph=True), t, True),
                 (self.module(), torch.full((211,), -100), True)]
        for m, targets, grad in cases:
            with torch.set_grad_enabled(grad):
                loss = m(x, w, targets)
            self.assertNotIsInstance(m._last, PipelinedStep)
            if grad:
                loss.sum().backward()
        self.assertTrue(torch.isnan(loss))  # mean over no rows, as in PyTorch


if __name__ == "__main__":
    sys.exit(run_tests(RowPipelineTest, "RowPipelineTest"))
