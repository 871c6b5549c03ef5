"""The Python client and RemoteLinearCrossEntropy against a real flce_server.

The centre piece: a tiny language model trained for several optimizer steps
with gradient accumulation, once with its LM head's loss computed by flce and
once by F.cross_entropy, must agree step by step (losses and parameters).
Run by Bazel (tests/BUILD) with the path of flce_server as the argument.
"""

import copy
import os
import sys
import time
import unittest
from unittest import mock

import grpc
import numpy as np
import torch
import torch.nn.functional as F

import flce
from flce import client as flce_client
from server_process import ServerProcess, run_tests, wait_for
from train_tiny_lm import TinyLM

SERVER = sys.argv[1]


def rel_err(a, b):
    a = torch.as_tensor(a, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


class PythonClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = ServerProcess(SERVER, "--backend=auto", "--enable_shared_memory")
        cls.client = flce.Client(cls.server.address)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.kill()

    def test_training_loop_matches_f_cross_entropy_step_by_step(self):
        self._training_loop(shared_memory=False)

    def test_training_loop_through_shared_memory(self):
        self._training_loop(shared_memory=True)

    def _needs_cuda_server(self):
        if not torch.cuda.is_available() or self.client.info().backend != "cuda":
            self.skipTest("needs a GPU and a server on the CUDA backend")

    def test_training_loop_through_cuda_ipc(self):
        self._needs_cuda_server()
        self._training_loop(shared_memory=False, device="cuda", cuda_ipc=True)

    def _training_loop(self, shared_memory, device="cpu", cuda_ipc=False):
        torch.manual_seed(0)
        reference = TinyLM(vocab=37, hidden=16).to(device)
        remote = copy.deepcopy(reference)
        loss_fn = flce.RemoteLinearCrossEntropy(self.client, label_smoothing=0.1,
                                                ignore_index=-100, shared_memory=shared_memory,
                                                cuda_ipc=cuda_ipc)
        self.addCleanup(loss_fn.close)
        opt_ref = torch.optim.SGD(reference.parameters(), lr=0.5)
        opt_remote = torch.optim.SGD(remote.parameters(), lr=0.5)
        # Over the network the head's gradients wait on the server until the
        # step (a no-op with shared memory and CUDA IPC).
        loss_fn.attach(opt_remote)
        gen = torch.Generator().manual_seed(1)
        for step in range(4):
            opt_ref.zero_grad()
            opt_remote.zero_grad()
            for micro in range(2):  # gradient accumulation over two micro-batches
                tokens = torch.randint(0, 37, (3, 11), generator=gen).to(device)
                targets = torch.randint(0, 37, (3, 11), generator=gen).to(device)
                targets[0, :2] = -100
                h_ref = reference.hidden_states(tokens)
                loss_ref = F.cross_entropy(reference.head(h_ref).reshape(-1, 37),
                                           targets.reshape(-1), ignore_index=-100,
                                           label_smoothing=0.1) / 2
                loss_ref.backward()
                h = remote.hidden_states(tokens)
                loss = loss_fn(h, remote.head.weight, targets, remote.head.bias) / 2
                loss.backward()
                self.assertLess(rel_err(loss.detach(), loss_ref.detach()), 1e-5,
                                f"step {step} micro-batch {micro}")
            opt_ref.step()
            opt_remote.step()
            if shared_memory:  # the tensors really went through a region
                self.assertIsNotNone(loss_fn._region)
            if not (shared_memory or cuda_ipc):  # W sent once per optimizer step
                self.assertEqual(loss_fn._registration.puts, step + 1)
            for (name, p_ref), (_, p) in zip(reference.named_parameters(),
                                             remote.named_parameters()):
                self.assertLess(rel_err(p.detach(), p_ref.detach()), 1e-5,
                                f"{name} after step {step}")

    def test_shared_memory_gradients_are_never_overwritten_while_alive(self):
        torch.manual_seed(10)
        loss_fn = flce.RemoteLinearCrossEntropy(self.client, shared_memory=True)
        t = torch.randint(0, 50, (9,))
        kept = []
        for step in range(3):
            h = torch.randn(9, 6, requires_grad=True)
            w = torch.randn(50, 6, requires_grad=True)
            loss_fn(h, w, t).backward()
            h_ref = h.detach().clone().requires_grad_()
            F.cross_entropy(h_ref @ w.detach().T, t).backward()
            want = h_ref.grad
            kept.append((h.grad, h.grad.clone(), want))
        # Three calls, every gradient still alive: each landed in a region no
        # earlier one was viewing, and none was written over.
        self.assertEqual(len(loss_fn._grad_regions), 3)
        for grad, copy_then, want in kept:
            self.assertTrue(torch.equal(grad, copy_then))
            self.assertLess(rel_err(grad, want), 1e-5)
        loss_fn.close()  # the views stay readable after the regions go
        for grad, copy_then, _ in kept:
            self.assertTrue(torch.equal(grad, copy_then))
        del kept
        # Once the gradients are gone the regions are reused, not added to.
        loss_fn = flce.RemoteLinearCrossEntropy(self.client, shared_memory=True)
        self.addCleanup(loss_fn.close)
        for _ in range(3):
            h = torch.randn(9, 6, requires_grad=True)
            loss_fn(h, torch.randn(50, 6, requires_grad=True), t).backward()
            del h
        self.assertEqual(len(loss_fn._grad_regions), 1)

    def test_cuda_ipc_equals_the_wire_bit_for_bit(self):
        self._needs_cuda_server()
        torch.manual_seed(5)
        h = torch.randn(37, 24, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(101, 24, device="cuda") / 3).to(torch.bfloat16)
        b = torch.randn(101, device="cuda", dtype=torch.bfloat16)
        t = torch.randint(0, 101, (37,), device="cuda")
        for mode in ("store_grads", "recompute"):
            results = []
            # The wire; then CUDA IPC twice: its Forward brings the gradients
            # for upstream 1, so the first backward (upstream 3) redoes them
            # with a Backward, and the second Forward brings them for 3.
            for cuda_ipc, step in ((False, 0), (True, 0), (True, 1)):
                if step == 0:
                    # The wire with W and dW as bytes (no registered weight).
                    loss_fn = flce.RemoteLinearCrossEntropy(self.client, z_loss_scale=1e-3,
                                                            cuda_ipc=cuda_ipc,
                                                            backward_mode=mode,
                                                            register_weight=False)
                hv, wv, bv = (x.clone().requires_grad_() for x in (h, w, b))
                loss = loss_fn(hv, wv, t, bv)
                (3 * loss).backward()
                results.append((loss.detach(), hv.grad, wv.grad, bv.grad))
                if cuda_ipc:
                    brought = loss_fn.last_stats[1] is None
                    self.assertEqual(brought, step == 1, f"{mode} step {step}")
            for wire, ipc, eager in zip(*results):
                self.assertEqual(ipc.device.type, "cuda", mode)
                self.assertTrue(torch.equal(wire.cpu(), ipc.cpu()), mode)
                self.assertTrue(torch.equal(wire.cpu(), eager.cpu()), mode)

    def test_cuda_ipc_slices_are_checked_and_released(self):
        import grpc
        from flce.client import to_wire
        from flce.cuda_ipc import CudaIpcRegistry
        from flce_pb.v1 import loss_service_pb2 as pb

        self._needs_cuda_server()
        h = torch.randn(8, 16, device="cuda")
        t = torch.randint(0, 10, (8,))
        w = torch.randn(10, 16)

        def forward_with(hidden_slice, target_on_gpu=False, ready_event=""):
            r = pb.ForwardRequest(ready_event=ready_event)
            r.hidden.dtype = pb.DTYPE_FLOAT32
            r.hidden.shape.extend([8, 16])
            r.hidden.shm.CopyFrom(hidden_slice)
            if target_on_gpu:
                r.target.dtype = pb.DTYPE_INT64
                r.target.shape.append(8)
                r.target.shm.CopyFrom(hidden_slice)
            else:
                to_wire(t, r.target)
            to_wire(w, r.weight)
            try:
                return self.client._stub.Forward(r, timeout=60)
            except grpc.RpcError as e:
                return e

        ipc = CudaIpcRegistry(self.client)
        good = ipc.slice(h)
        expected = self.client.forward(h.cpu(), t, w).loss
        self.assertEqual(forward_with(good).loss, expected)
        past_the_end = pb.SharedMemorySlice(region_id=good.region_id, offset=1 << 40)
        self.assertEqual(forward_with(past_the_end).code(), grpc.StatusCode.INVALID_ARGUMENT)
        e = forward_with(good, target_on_gpu=True)
        self.assertEqual(e.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("hidden and weight only", e.details())
        # An input never accumulates; memory is no event, an event no memory.
        adding = pb.SharedMemorySlice(region_id=good.region_id, offset=0, accumulate=True)
        self.assertEqual(forward_with(adding).code(), grpc.StatusCode.INVALID_ARGUMENT)
        e = forward_with(good, ready_event=good.region_id)
        self.assertEqual(e.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("not an event", e.details())
        token, event_region = ipc.record_ready(h.device)
        self.assertEqual(forward_with(good, ready_event=event_region).loss, expected)
        e = forward_with(pb.SharedMemorySlice(region_id=event_region))
        self.assertEqual(e.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("is an event", e.details())
        ipc.done(token)
        # Registrations last until close() (or until their memory is gone).
        self.assertEqual(forward_with(good).loss, expected)
        ipc.close()
        self.assertEqual(forward_with(good).code(), grpc.StatusCode.NOT_FOUND)

    def _ipc_step(self, loss_fn, h, w, t):
        hv, wv = h.detach().requires_grad_(), w.detach().requires_grad_()
        loss = loss_fn(hv, wv, t)
        loss.backward()
        return loss.detach(), hv.grad, wv.grad

    def test_cuda_ipc_registrations_last_across_calls(self):
        self._needs_cuda_server()
        before = self.client.stats().shared_memory_regions
        client = flce.Client(self.server.address)
        try:
            torch.manual_seed(6)
            h = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
            w = (torch.randn(1000, 32, device="cuda") / 6).to(torch.bfloat16)
            t = torch.randint(0, 1000, (64,), device="cuda")
            loss_fn = flce.RemoteLinearCrossEntropy(client, cuda_ipc=True)
            self._ipc_step(loss_fn, h, w, t)
            first = client.cuda_ipc().registrations
            regions = client.stats().shared_memory_regions
            for _ in range(3):
                self._ipc_step(loss_fn, h, w, t)
            # Steady state: the same allocations (the caching allocator hands
            # the gradients the same blocks), no new registration.
            self.assertEqual(client.cuda_ipc().registrations, first)
            self.assertEqual(client.stats().shared_memory_regions, regions)
        finally:
            client.close()
        # close() unregisters everything the client registered.
        self.assertEqual(self.client.stats().shared_memory_regions, before)

    def test_cuda_ipc_never_reads_a_freed_allocation_at_the_same_address(self):
        self._needs_cuda_server()
        client = flce.Client(self.server.address)
        try:
            torch.manual_seed(7)
            rows, hidden, vocab = 512, 1024, 300  # X alone: 1 MiB in fp32, its own segment
            w = torch.randn(vocab, hidden, device="cuda") / 30
            t = torch.randint(0, vocab, (rows,))
            registry = client.cuda_ipc()
            a = torch.randn(rows, hidden, device="cuda") * 4
            loss_a = client.forward(a, t, w, cuda_ipc=True).loss
            address, count = a.data_ptr(), registry.registrations
            entries, regions = registry.registered(), client.stats().shared_memory_regions
            del a
            torch.cuda.empty_cache()  # the segment goes back to the driver
            b = torch.randn(rows, hidden, device="cuda")
            got = client.forward(b, t, w, cuda_ipc=True).loss
            want = client.forward(b.cpu(), t, w.cpu()).loss
            self.assertEqual(flce.from_wire(got), flce.from_wire(want))
            self.assertNotEqual(flce.from_wire(got), flce.from_wire(loss_a))
            if b.data_ptr() == address:
                # The same address, a new allocation: registered anew.
                self.assertGreater(registry.registrations, count)
            # The freed allocation's registration is gone, client and server:
            # B's took its place.
            self.assertEqual(registry.registered(), entries)
            self.assertEqual(client.stats().shared_memory_regions, regions)
        finally:
            client.close()

    def test_cuda_ipc_waits_for_the_workers_stream_not_the_device(self):
        self._needs_cuda_server()
        torch.manual_seed(8)
        data = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(500, 64, device="cuda") / 8).to(torch.bfloat16)
        t = torch.randint(0, 500, (256,))  # on the host: no implicit synchronisation
        want = self.client.forward(data, t, w).loss  # inline bytes
        for _ in range(3):
            h = torch.zeros_like(data)
            torch.cuda.synchronize()
            # A slow kernel, then the producer of X, both still queued when
            # the call goes out: only the event orders the server after them.
            torch.cuda._sleep(50_000_000)
            h.copy_(data)
            got = self.client.forward(h, t, w, cuda_ipc=True).loss
            self.assertEqual(flce.from_wire(got), flce.from_wire(want))

    def test_cuda_ipc_forward_returns_once_accepted_and_the_stream_waits_for_it(self):
        # The drop-in's Forward (through a call channel) returns before the
        # server is done: work queued after it must still see the loss and
        # the gradients the server writes.
        self._needs_cuda_server()
        torch.manual_seed(9)
        h = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(32000, 1024, device="cuda") / 32).to(torch.bfloat16)
        t = torch.randint(0, 32000, (4096,), device="cuda")
        grpc_client = flce.Client(self.server.address, call_channel=False)
        self.addCleanup(grpc_client.close)
        wire = flce.RemoteLinearCrossEntropy(grpc_client, cuda_ipc=True)
        fast = flce.RemoteLinearCrossEntropy(self.client, cuda_ipc=True)
        self.addCleanup(wire.close)
        self.addCleanup(fast.close)
        results = []
        for loss_fn in (wire, fast, fast):
            hv, wv = h.clone().requires_grad_(), w.clone().requires_grad_()
            loss = loss_fn(hv, wv, t)
            doubled = loss * 2  # queued behind the server's answer
            loss.backward()
            hx = hv.grad.float().sum()  # likewise
            results.append((doubled.item(), hx.item(), wv.grad.clone()))
        self.assertIsNotNone(self.client.call_channel())
        for got in results[1:]:
            self.assertEqual(got[:2], results[0][:2])
            self.assertTrue(torch.equal(got[2], results[0][2]))

    def test_cuda_ipc_a_computation_failing_after_acceptance_raises_in_backward(self):
        self._needs_cuda_server()
        torch.manual_seed(10)
        h = torch.randn(65536, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(65536, 2048, device="cuda") / 45).to(torch.bfloat16).requires_grad_()
        t = torch.randint(0, 65536, (65536,), device="cuda")
        client = flce.Client(self.server.address, timeout=0.02)  # far less than it takes
        loss_fn = flce.RemoteLinearCrossEntropy(client, cuda_ipc=True)
        self.addCleanup(client.close)
        self.addCleanup(loss_fn.close)
        loss = loss_fn(h, w, t)
        self.assertTrue(torch.isnan(loss).item())  # the stream went on: the answer came
        with self.assertRaises(flce.FlceError) as e:
            loss.backward()
        self.assertEqual(e.exception.code.name, "DEADLINE_EXCEEDED")
        client.timeout = 60
        small = loss_fn(h[:64].detach().requires_grad_(), w, t[:64])
        self.assertTrue(torch.isfinite(small).item())

    def test_cuda_ipc_a_server_dying_mid_call_releases_the_stream(self):
        self._needs_cuda_server()
        server = ServerProcess(SERVER, "--backend=cuda", "--enable_shared_memory")
        self.addCleanup(server.kill)
        client = flce.Client(server.address)
        loss_fn = flce.RemoteLinearCrossEntropy(client, cuda_ipc=True)
        self.addCleanup(client.close)
        torch.manual_seed(11)
        h = torch.randn(65536, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(128256, 4096, device="cuda") / 64).to(torch.bfloat16).requires_grad_()
        t = torch.randint(0, 128256, (65536,), device="cuda")
        loss_fn(h[:128].detach().requires_grad_(), w, t[:128]).backward()  # registered, warm
        loss = loss_fn(h, w, t)
        server.process.kill()  # while it computes
        start = time.monotonic()
        torch.cuda.synchronize()  # waits for the fence, which the client stores itself
        self.assertLess(time.monotonic() - start, 30)
        with self.assertRaises(flce.FlceError) as e:
            loss.backward()
        self.assertEqual(e.exception.code.name, "UNAVAILABLE")

    def test_weight_grad_in_place_equals_autograd_accumulation(self):
        self._needs_cuda_server()
        torch.manual_seed(9)
        h = [torch.randn(40, 24, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        w0 = (torch.randn(301, 24, device="cuda") / 5).to(torch.bfloat16)
        b0 = torch.randn(301, device="cuda", dtype=torch.bfloat16)
        t = torch.randint(0, 301, (40,), device="cuda")
        grads = []
        for in_place in (False, True):
            w, b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
            loss_fn = flce.RemoteLinearCrossEntropy(self.client, cuda_ipc=True,
                                                    weight_grad_in_place=in_place)
            for x in h:  # gradient accumulation over three micro-batches
                loss_fn(x, w, t, b).backward()
            grads.append((w.grad, b.grad))
        self.assertTrue(torch.equal(grads[0][0], grads[1][0]))
        self.assertTrue(torch.equal(grads[0][1], grads[1][1]))

    def test_reduction_none_and_bf16_round_trip(self):
        torch.manual_seed(2)
        h = torch.randn(5, 8, dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(13, 8) / 3).to(torch.bfloat16).requires_grad_()
        t = torch.randint(0, 13, (5,))
        loss_fn = flce.RemoteLinearCrossEntropy(self.client, reduction="none")
        self.addCleanup(loss_fn.close)
        loss = loss_fn(h, w, t)
        self.assertEqual(loss.shape, (5,))
        upstream = torch.arange(1.0, 6.0)
        (loss * upstream).sum().backward()
        self.assertIsNone(w.grad)  # summed on the server until pulled
        loss_fn.pull_weight_grads()
        self.assertEqual(h.grad.dtype, torch.bfloat16)
        h64 = h.detach().double().requires_grad_()
        w64 = w.detach().double().requires_grad_()
        ref = F.cross_entropy(h64 @ w64.T, t, reduction="none")
        (ref * upstream.double()).sum().backward()
        # The bar of DESIGN §3: no worse than 1.5× the plain bf16 computation
        # (eager PyTorch: bf16 logits, fp32 loss), or bf16's unit roundoff.
        hp = h.detach().clone().requires_grad_()
        wp = w.detach().clone().requires_grad_()
        plain = F.cross_entropy((hp @ wp.T).float(), t, reduction="none")
        (plain * upstream).sum().backward()

        def bar(plain_value, exact):
            return max(1.5 * rel_err(plain_value, exact), 2.0 ** -8)

        self.assertLessEqual(rel_err(loss.detach(), ref.detach()), bar(plain.detach(), ref.detach()))
        self.assertLessEqual(rel_err(h.grad.float(), h64.grad), bar(hp.grad.float(), h64.grad))
        self.assertLessEqual(rel_err(w.grad.float(), w64.grad), bar(wp.grad.float(), w64.grad))

    def test_registered_weight_and_server_side_accumulation(self):
        rng = np.random.default_rng(3)
        w = (rng.standard_normal((29, 6)) / 3).astype(np.float32)
        b = rng.standard_normal(29).astype(np.float32)
        client = flce.Client(self.server.address, stream_chunk_bytes=100)
        info = client.put_weight("py_head", w, b)
        self.assertGreaterEqual(info.version, 1)
        x = rng.standard_normal((12, 6)).astype(np.float32)
        t = rng.integers(0, 29, 12)
        expected_w = np.zeros_like(w, dtype=np.float64)
        for k in range(2):
            rows = slice(6 * k, 6 * k + 6)
            fwd = client.forward(x[rows], t[rows], weight_name="py_head", reduction="sum",
                                 need_backward=True)
            grads = client.backward(fwd.session_id, accumulate_weight_grad=True)
            self.assertIsNone(grads.grad_weight)
            inline = client.forward(x[rows], t[rows], w, b, reduction="sum", need_backward=True)
            expected_w += flce.from_wire(client.backward(inline.session_id).grad_weight)
        dw, db, count = client.take_weight_grad("py_head")
        self.assertEqual(count, 2)
        self.assertLess(rel_err(flce.from_wire(dw), expected_w), 1e-6)
        self.assertEqual(tuple(db.shape), (29,))
        self.assertTrue(client.delete_weight("py_head"))

    def _live_sessions_become(self, n):
        import gc
        import time
        gc.collect()
        for _ in range(200):
            if self.client.info().live_sessions == n:
                return
            time.sleep(0.02)
        self.assertEqual(self.client.info().live_sessions, n)

    def test_sessions_released_with_the_next_forward(self):
        before = self.client.info().live_sessions
        h, w, t = torch.randn(4, 3), torch.randn(5, 3), torch.randint(0, 5, (4,))
        first = self.client.forward(h, t, w, need_backward=True).session_id
        self.client.release_with_next_forward(first)
        self.assertEqual(self.client.info().live_sessions, before + 1)  # not yet
        second = self.client.forward(h, t, w, need_backward=True).session_id
        self.assertEqual(self.client.info().live_sessions, before + 1)  # the second only
        self.client.release_session(second)
        self._live_sessions_become(before)

    def test_a_held_call_keeps_the_channels_completion_thread(self):
        import grpc._channel

        started = []  # gRPC's thread that completes a channel's calls, each start
        real = grpc._channel._run_channel_spin_thread
        patch = mock.patch.object(grpc._channel, "_run_channel_spin_thread",
                                  side_effect=lambda state: (started.append(1), real(state)))

        def calls(client, n):
            for _ in range(n):
                client._stub.GetServerInfo.future(flce_client.pb.GetServerInfoRequest(),
                                                  timeout=30).result()
                time.sleep(0.01)  # the thread of a call with none after it ends

        # Without one, each call made while none is in flight starts it anew.
        plain = flce.Client(self.server.address)
        self.addCleanup(plain.close)
        with patch:
            calls(plain, 3)
        self.assertEqual(len(started), 3)
        held = flce.Client(self.server.address)
        self.addCleanup(held.close)
        started.clear()
        with patch:
            held.hold_channel_thread()
            calls(held, 3)
            held.hold_channel_thread()  # still open: no second one
        self.assertEqual(len(started), 1)
        call = held._held_call
        self.assertFalse(call.done())
        held.close()
        self.assertTrue(call.done())
        self.assertGreaterEqual(plain.info().live_sessions, 0)  # the server serves on

    def test_a_server_that_refuses_a_held_call_is_not_asked_again(self):
        server = ServerProcess(SERVER, "--backend=cpu", "--max_health_watches=0")
        self.addCleanup(server.kill)
        client = flce.Client(server.address)
        self.addCleanup(client.close)
        client.hold_channel_thread()
        wait_for(lambda: client._held_call.done(), "the refused watch to end")
        self.assertEqual(client._held_call.code(), grpc.StatusCode.RESOURCE_EXHAUSTED)
        client.hold_channel_thread()
        self.assertIs(client._held_call, False)
        client.hold_channel_thread()  # and no call made
        self.assertIs(client._held_call, False)
        self.assertGreaterEqual(client.info().live_sessions, 0)

    def test_a_weight_changed_without_a_pull_warns(self):
        w = torch.randn(11, 4, requires_grad=True)
        loss_fn = flce.RemoteLinearCrossEntropy(self.client)
        self.addCleanup(loss_fn.close)
        t = torch.randint(0, 11, (6,))
        loss_fn(torch.randn(6, 4), w, t).backward()
        self.assertEqual(loss_fn._registration.pending, 1)
        with torch.no_grad():
            w.add_(1.0)  # an optimizer step that nobody pulled for
        with self.assertWarnsRegex(RuntimeWarning, "pull_weight_grads"):
            loss_fn(torch.randn(6, 4), w, t)
        self.assertEqual(loss_fn._registration.puts, 2)

    def test_no_session_is_kept_without_a_backward(self):
        torch.manual_seed(3)
        loss_fn = flce.RemoteLinearCrossEntropy(self.client)
        head = torch.nn.Linear(8, 29)
        hidden = torch.randn(5, 8)
        targets = torch.randint(0, 29, (5,))
        before = self.client.info().live_sessions  # (other clients' sessions)
        with torch.no_grad():  # evaluation: nothing to keep
            loss_fn(hidden, head.weight, targets, head.bias)
        self.assertEqual(self.client.info().live_sessions, before)
        # A loss dropped without backward() releases its session.
        loss = loss_fn(hidden, head.weight, targets, head.bias)
        self.assertEqual(self.client.info().live_sessions, before + 1)
        del loss
        self._live_sessions_become(before)

    def test_backward_twice_raises_or_with_retain_graph_adds_again(self):
        torch.manual_seed(4)
        head = torch.nn.Linear(8, 29)
        hidden = torch.randn(5, 8)
        targets = torch.randint(0, 29, (5,))
        before = self.client.info().live_sessions
        loss = flce.RemoteLinearCrossEntropy(self.client)(hidden, head.weight, targets, head.bias)
        loss.backward(retain_graph=True)
        with self.assertRaisesRegex(RuntimeError, "retain_graph=True"):
            loss.backward()
        del loss
        self._live_sessions_become(before)
        # With retain_graph=True the gradients add up as torch's do.
        ref = torch.nn.Linear(8, 29)
        ref.load_state_dict(head.state_dict())
        head.zero_grad()
        loss_fn = flce.RemoteLinearCrossEntropy(self.client, retain_graph=True)
        self.addCleanup(loss_fn.close)
        loss = loss_fn(hidden, head.weight, targets, head.bias)
        loss.backward(retain_graph=True)
        loss.backward()
        loss_fn.pull_weight_grads()
        ref_loss = F.cross_entropy(ref(hidden), targets)
        ref_loss.backward(retain_graph=True)
        ref_loss.backward()
        self.assertLess(rel_err(head.weight.grad, ref.weight.grad), 1e-5)
        self.assertEqual(self.client.info().live_sessions, before + 1)  # until the graph goes
        del loss
        self._live_sessions_become(before)

    def test_put_weight_and_take_in_chunks_within_a_small_message_limit(self):
        server = ServerProcess(SERVER, "--backend=cpu", "--max_message_bytes=65536")
        self.addCleanup(server.kill)
        client = flce.Client(server.address, max_message_bytes=65536)
        self.addCleanup(client.close)
        rng = np.random.default_rng(5)
        w = (rng.standard_normal((300, 64)) / 8).astype(np.float32)  # 75 KiB
        client.put_weight("w", w)
        x = rng.standard_normal((4, 64)).astype(np.float32)
        t = rng.integers(0, 300, 4)
        session = client.forward(x, t, weight_name="w", need_backward=True).session_id
        client.backward(session, accumulate_weight_grad=True)
        dw, _, backwards = client.take_weight_grad("w")
        self.assertEqual(backwards, 1)
        self.assertEqual(len(dw.data), 300 * 64 * 4)
        with self.assertRaises(flce.FlceError) as e:
            client.take_weight_grad("w")
        self.assertIn("no gradient", e.exception.details)

    def test_errors_carry_the_grpc_code(self):
        import grpc

        with self.assertRaises(flce.FlceError) as e:
            self.client.backward("0" * 32)
        self.assertEqual(e.exception.code, grpc.StatusCode.NOT_FOUND)
        with self.assertRaises(flce.FlceError) as e:
            self.client.forward(np.ones((2, 3), np.float32), np.array([0, 9]),
                                np.ones((4, 3), np.float32))
        self.assertEqual(e.exception.code, grpc.StatusCode.OUT_OF_RANGE)
        self.assertIn("target[1] = 9", e.exception.details)

    def test_bad_options_are_value_errors_when_the_module_is_built(self):
        for kwargs, named in [({"reduction": "avg"}, "reduction='avg': choose one of 'mean'"),
                              ({"backward_mode": "fast"}, "backward_mode='fast'"),
                              ({"label_smoothing": 1.0}, "label_smoothing=1.0"),
                              ({"logit_softcap": 0.0}, "logit_softcap=0.0"),
                              ({"z_loss_scale": -1.0}, "z_loss_scale=-1.0")]:
            with self.assertRaises(ValueError) as e:
                flce.RemoteLinearCrossEntropy(self.client, **kwargs)
            self.assertIn(named, str(e.exception))
        with self.assertRaises(ValueError):
            self.client.forward(np.ones((2, 3), np.float32), np.array([0, 1]),
                                np.ones((4, 3), np.float32), reduction="avg")

    def test_the_package_is_the_installed_wheel_of_the_servers_version(self):
        self.assertEqual(flce.__version__, self.client.info().version)
        if os.environ.get("FLCE_FROM_WHEEL"):
            # Installed like a user's: from the wheel, not the source tree.
            self.assertIn("site-packages", flce.__file__)
            self.assertIn("site-packages", flce.client.pb.__file__)

    def test_a_host_without_a_port_means_50051(self):
        for target, want in [("localhost", "localhost:50051"), ("10.0.0.7", "10.0.0.7:50051"),
                             ("[::1]", "[::1]:50051"), ("::1", "[::1]:50051"),
                             ("dns:///flce.ml.svc", "dns:///flce.ml.svc:50051"),
                             ("localhost:7", "localhost:7"), ("[::1]:7", "[::1]:7"),
                             ("dns:///flce.ml.svc:7", "dns:///flce.ml.svc:7"),
                             ("unix:/run/flce.sock", "unix:/run/flce.sock")]:
            self.assertEqual(flce.with_default_port(target), want)

    def test_example_training_script_learns(self):
        import train_tiny_lm

        losses = train_tiny_lm.main(["--server", self.server.address, "--steps", "8",
                                     "--vocab", "50", "--hidden", "16", "--device", "cpu"])
        self.assertEqual(len(losses), 8)
        self.assertLess(losses[-1], losses[0])
        # --compare: a copy trained with PyTorch's loss stays equal.
        losses, drift = train_tiny_lm.main(["--server", self.server.address, "--steps", "3",
                                            "--vocab", "50", "--hidden", "16", "--device", "cpu",
                                            "--compare"])
        self.assertLess(drift, 1e-4)

    def test_put_weight_is_checked_with_zlibs_crc32(self):
        self.assertEqual(flce_client.weight_checksum(b"123456789"), {"crc32": 0xCBF43926})
        info = self.client.put_weight("checked", torch.randn(7, 5))
        self.assertEqual(info.bytes, 7 * 5 * 4)
        self.client.delete_weight("checked")


if __name__ == "__main__":
    sys.exit(run_tests(PythonClientTest, "python_client"))
