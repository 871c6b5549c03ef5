"""Call channels (OpenCallChannel) against a real flce_server: the same
answers as gRPC, the same errors, the fallbacks, and a hostile client.

Run by Bazel (tests/BUILD) with the path of flce_server as the argument.
"""

import ctypes
import os
import re
import signal
import struct
import sys
import time
import unittest

import grpc
import numpy as np

import flce
from flce import call_channel
from flce import client as flce_client
from flce_pb.v1 import loss_service_pb2 as pb
from server_process import ServerProcess, run_tests, wait_for

SERVER = sys.argv[1]


def problem(seed, n=37, h=16, v=101):
    r = np.random.default_rng(seed)
    x = r.standard_normal((n, h)).astype(np.float32)
    w = (r.standard_normal((v, h)) / 4).astype(np.float32)
    t = r.integers(0, v, n)
    t[:3] = -100
    return x, w, t


def region_forward(region, x, w, t):
    """A ForwardRequest whose X and W are in `region`, the targets inline."""
    request = pb.ForwardRequest()
    offset = 0
    for tensor, out in ((x, request.hidden), (w, request.weight)):
        offset = region.write(tensor, out, offset)
    flce.to_wire(t, request.target)
    return request


def channel_calls(server):
    return len(re.findall(r"rpc=(Forward|Backward|ReleaseSession) via=channel", server.read_log()))


@unittest.skipUnless(call_channel.supported(), "call channels need x86-64 Linux")
class CallChannelTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = ServerProcess(SERVER, "--backend=cpu", "--enable_shared_memory",
                                   "--call_channel_idle_timeout=2s")

    @classmethod
    def tearDownClass(cls):
        cls.server.kill()

    def client(self, **kwargs):
        c = flce.Client(self.server.address, **kwargs)
        self.addCleanup(c.close)
        return c

    def test_calls_through_a_channel_equal_grpc_bit_for_bit(self):
        x, w, t = problem(1)
        answers = []
        for mode in (True, False):
            c = self.client(call_channel=mode)
            before = channel_calls(self.server)
            fwd = c.forward(x, t, w, need_backward=True, label_smoothing=0.1, want_lse=True)
            grads = c.backward(fwd.session_id, np.float32(0.5))
            self.assertEqual(c.release_session(fwd.session_id), False)  # consumed
            used = channel_calls(self.server) - before
            self.assertEqual(used, 3 if mode else 0)
            answers.append((fwd.loss.data, fwd.lse.data, fwd.num_valid, grads.grad_hidden.data,
                            grads.grad_weight.data))
        self.assertEqual(answers[0], answers[1])

    def test_shared_memory_calls_take_a_channel_by_themselves(self):
        x, w, t = problem(2)
        c = self.client()
        region = c.create_shared_memory(1 << 20)
        self.addCleanup(region.close)
        before = channel_calls(self.server)
        fwd = c.forward(x, t, w, shm=region, need_backward=True)
        c.backward(fwd.session_id, shm=region)
        self.assertEqual(channel_calls(self.server) - before, 2)
        self.assertGreaterEqual(c.stats().call_channels, 1)
        # Without shared memory the same client stays on gRPC.
        c.forward(x, t, w)
        self.assertEqual(channel_calls(self.server) - before, 2)

    def test_errors_carry_the_grpc_code_and_the_channel_serves_on(self):
        x, w, t = problem(3)
        c = self.client(call_channel=True)
        bad = t.copy()
        bad[5] = 101
        with self.assertRaises(flce.FlceError) as e:
            c.forward(x, bad, w)
        self.assertEqual(e.exception.code, grpc.StatusCode.OUT_OF_RANGE)
        self.assertIn("target[5] = 101", e.exception.details)
        with self.assertRaises(flce.FlceError) as e:
            c.backward("0" * 32)
        self.assertEqual(e.exception.code, grpc.StatusCode.NOT_FOUND)
        fwd = c.forward(x, t, w, need_backward=True)
        c.backward(fwd.session_id)
        with self.assertRaises(flce.FlceError) as e:
            c.backward(fwd.session_id)
        self.assertEqual(e.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
        self.assertIsNotNone(c.call_channel())

    def test_a_request_larger_than_the_channel_goes_through_grpc(self):
        x, w, t = problem(4, n=3000, h=100, v=500)  # 1.2 MB of hidden states
        c = self.client(call_channel=True)
        before = channel_calls(self.server)
        fwd = c.forward(x, t, w)
        self.assertEqual(channel_calls(self.server), before)
        self.assertTrue(np.isfinite(flce.from_wire(fwd.loss)).all())

    def test_a_deadline_passed_while_computing_is_deadline_exceeded(self):
        x, w, t = problem(5, n=4096, h=512, v=8000)
        c = self.client(call_channel=True, timeout=0.02)
        with self.assertRaises(flce.FlceError) as e:
            c.forward(x, t, w)
        self.assertEqual(e.exception.code, grpc.StatusCode.DEADLINE_EXCEEDED)
        c.timeout = 30
        sx, sw, st = problem(6)
        c.forward(sx, st, sw)
        self.assertIsNotNone(c.call_channel())

    def test_a_channel_the_server_closed_when_idle_is_opened_again(self):
        x, w, t = problem(7)
        c = self.client(call_channel=True)
        first = c.forward(x, t, w)
        old = c.call_channel().channel_id
        wait_for(lambda: "closed: no call for 2s" in self.server.read_log(), "the idle close")
        again = c.forward(x, t, w)
        self.assertEqual(first.loss.data, again.loss.data)
        self.assertNotEqual(c.call_channel().channel_id, old)

    def test_a_forward_is_accepted_before_its_answer_and_fenced_after_it(self):
        c = self.client(call_channel=True)
        channel = c.call_channel()
        words = channel._words
        x, w, t = problem(11, n=2048, h=256, v=8000)  # a few hundred ms on the CPU
        region = c.create_shared_memory(16 << 20)
        self.addCleanup(region.close)
        request = region_forward(region, x, w, t)
        call = channel.submit(call_channel.FORWARD, request, pb.ForwardResponse, 60)
        self.assertTrue(channel.accepted(call))
        self.assertNotEqual(words[call_channel._FENCE_SEQ].value, call.seq)
        response = channel.finish(call)
        self.assertEqual(words[call_channel._FENCE_SEQ].value, call.seq)
        self.assertEqual(response.num_valid, 2045)
        # A refusal comes before any acceptance.
        request.target.data = np.full(2048, 8000).astype(np.int64).tobytes()
        call = channel.submit(call_channel.FORWARD, request, pb.ForwardResponse, 60)
        self.assertFalse(channel.accepted(call))
        with self.assertRaises(flce.FlceError) as e:
            channel.finish(call)
        self.assertEqual(e.exception.code, grpc.StatusCode.OUT_OF_RANGE)

    def test_a_watched_call_of_a_server_that_stops_beating_gets_its_fence(self):
        # The watch thread stores the fence itself once the heartbeat stops
        # (a GPU stream waiting on it must go on), not while it beats.
        server = ServerProcess(SERVER, "--backend=cpu", "--enable_shared_memory")
        self.addCleanup(server.kill)
        c = flce.Client(server.address, call_channel=True)
        self.addCleanup(c.close)
        channel = c.call_channel()
        fence = channel._words[call_channel._FENCE_SEQ]
        x, w, t = problem(13, n=2048, h=512, v=16000)  # most of a second on the CPU
        region = c.create_shared_memory(40 << 20)
        self.addCleanup(region.close)
        for round_ in range(2):  # the second call meets a watch thread already running
            request = region_forward(region, x, w, t)
            call = channel.submit(call_channel.FORWARD, request, pb.ForwardResponse, 60)
            self.assertTrue(channel.accepted(call))
            channel.watch(call)
            if round_ == 0:
                self.assertEqual(channel.finish(call).num_valid, 2045)
                time.sleep(0.3)  # the thread looks at an answered call
                continue
            os.kill(server.process.pid, signal.SIGSTOP)
            try:
                time.sleep(1.0)
                self.assertNotEqual(fence.value, call.seq)  # still beating a second ago
                wait_for(lambda: fence.value == call.seq, "the fence stored by the watch thread")
            finally:
                os.kill(server.process.pid, signal.SIGCONT)
            self.assertEqual(channel.finish(call).num_valid, 2045)  # the server went on

    def test_the_loss_is_written_to_loss_out(self):
        x, w, t = problem(12)
        c = self.client(call_channel=False)
        region = c.create_shared_memory(1 << 16)
        self.addCleanup(region.close)
        for reduction, n in (("mean", 1), ("none", len(t))):
            request = pb.ForwardRequest()
            for tensor, out in ((x, request.hidden), (w, request.weight), (t, request.target)):
                flce.to_wire(tensor, out)
            request.options.reduction = flce_client._REDUCTIONS[reduction]
            request.options.ignore_index = -100
            request.loss_out.region_id = region.region_id
            request.loss_out.offset = 128
            region.buffer[128:128 + 4 * n] = b"\xff" * (4 * n)
            response = c._call(c._stub.Forward, request)
            self.assertEqual(bytes(region.buffer[128:128 + 4 * n]), response.loss.data)
        request.loss_out.offset = (1 << 16) - 2
        with self.assertRaises(flce.FlceError) as e:
            c._call(c._stub.Forward, request)
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("loss_out.shm", e.exception.details)
        request.loss_out.offset = 0
        request.loss_out.accumulate = True
        with self.assertRaises(flce.FlceError) as e:
            c._call(c._stub.Forward, request)
        self.assertIn("loss_out.accumulate", e.exception.details)

    def test_opening_is_checked(self):
        c = self.client(call_channel=False)
        stub = c._stub
        with self.assertRaises(grpc.RpcError) as e:
            stub.OpenCallChannel(pb.OpenCallChannelRequest(region_id="f" * 32, request_bytes=4096,
                                                           response_bytes=4096))
        self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)
        region = c.create_shared_memory(3 * 4096)  # no magic in it
        self.addCleanup(region.close)
        for request_bytes, response_bytes, text in ((4096, 4096, "magic"),
                                                    (100, 4096, "request_bytes: 100"),
                                                    (4096, 8192, "do not fit")):
            with self.assertRaises(grpc.RpcError) as e:
                stub.OpenCallChannel(pb.OpenCallChannelRequest(
                    region_id=region.region_id, request_bytes=request_bytes,
                    response_bytes=response_bytes))
            self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn(text, e.exception.details())

    def test_a_hostile_client_cannot_hurt_the_server(self):
        c = self.client()
        channel = c.call_channel()
        buf = channel._region.buffer
        words = channel._words
        rng = np.random.default_rng(8)
        # Garbage requests of every kind, numbered as calls.
        for i in range(40):
            body = rng.integers(0, 256, int(rng.integers(0, 5000))).astype(np.uint8).tobytes()
            buf[call_channel.HEADER_BYTES:call_channel.HEADER_BYTES + min(len(body), 4096)] = \
                body[:4096]
            struct.pack_into("<IIQ", buf, 448, int(rng.integers(0, 6)),
                             int(rng.integers(0, 1 << 32)), int(rng.integers(0, 1 << 63)))
            words[64].value = 1000 + i
            libc = ctypes.CDLL(None)
            libc.syscall(202, ctypes.c_void_p(channel._addr[64]), 1, 1, None, None, 0)
            wait_for(lambda: words[128].value == 1000 + i or words[384].value,
                     "an answer to garbage", timeout=10)
        self.assertTrue(c.info().version)
        # Its object shrunk under the server: the channel goes, the server stays.
        os.ftruncate(channel._region._shm._fd, 0)
        wait_for(lambda: c.stats().call_channels == 0, "the channel to close")
        x, w, t = problem(9)
        other = self.client(call_channel=True)
        self.assertTrue(np.isfinite(flce.from_wire(other.forward(x, t, w).loss)).all())

    def test_without_channels_a_client_falls_back_to_grpc(self):
        for flags in ((), ("--enable_shared_memory", "--max_call_channels=0")):
            server = ServerProcess(SERVER, "--backend=cpu", *flags)
            try:
                c = flce.Client(server.address, call_channel=True)
                x, w, t = problem(10)
                self.assertTrue(np.isfinite(flce.from_wire(c.forward(x, t, w).loss)).all())
                self.assertIsNone(c.call_channel())
                self.assertNotIn("via=channel", server.read_log())
                c.close()
            finally:
                server.kill()


if __name__ == "__main__":
    sys.exit(run_tests(CallChannelTest, "CallChannelTest"))
