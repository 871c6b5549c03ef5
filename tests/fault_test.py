"""Faults against the real flce_server binary: a client killed in the middle
of a stream, sessions expiring under load, SIGTERM with work in flight, and
a TLS + token server reached from the Python client. After each, the server
must hold nothing for the gone (no running task, no session, no reserved
memory) and keep serving.

Run by Bazel (tests/BUILD) with the path of flce_server as the argument.
"""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import unittest

import grpc
import numpy as np

import flce
from server_process import ServerProcess, run_tests, tls_flags, wait_for

SERVER = sys.argv[1]
CERTS = os.path.join(os.environ.get("TEST_SRCDIR", "."), "flce", "tests", "testdata", "tls")


def problem(rng, n=64, h=32, v=500):
    x = rng.standard_normal((n, h)).astype(np.float32)
    w = (rng.standard_normal((v, h)) / 4).astype(np.float32)
    t = rng.integers(0, v, n)
    return x, w, t


def request_count(stats, rpc, code):
    return sum(r.count for r in stats.requests if r.rpc == rpc and r.code == code)


class FaultTest(unittest.TestCase):
    def idle(self, client):
        info = client.info()
        return (info.running_requests == 0 and info.queued_requests == 0 and
                info.live_sessions == 0 and info.session_memory_bytes == 0)

    def test_client_killed_mid_stream_leaves_nothing_behind(self):
        server = ServerProcess(SERVER, "--backend=cpu")
        self.addCleanup(server.kill)
        client = flce.Client(server.address)
        # A child process streams a Forward slowly and is killed mid-stream.
        child = textwrap.dedent(f"""
            import sys, time, grpc
            from flce_pb.v1 import loss_service_pb2 as pb, loss_service_pb2_grpc as pb_grpc
            stub = pb_grpc.LossServiceStub(grpc.insecure_channel("{server.address}"))
            def chunks():
                r = pb.ForwardRequest(need_backward=True)
                r.hidden.dtype = pb.DTYPE_FLOAT32; r.hidden.shape.extend([4096, 1024])
                r.weight.dtype = pb.DTYPE_FLOAT32; r.weight.shape.extend([1000, 1024])
                r.weight.data = bytes(1000 * 1024 * 4)
                r.target.dtype = pb.DTYPE_INT64; r.target.shape.append(4096)
                r.target.data = bytes(4096 * 8)
                yield pb.ForwardRequestChunk(request=r)
                for i in range(1000):
                    c = pb.ForwardRequestChunk()
                    c.chunk.field = pb.TENSOR_FIELD_HIDDEN
                    c.chunk.data = bytes(16384)
                    yield c
                    if i == 10:
                        print("streaming", flush=True)
                    time.sleep(0.01)
            stub.ForwardStream(chunks(), timeout=60)
        """)
        proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE,
                                env=dict(os.environ))
        self.assertEqual(proc.stdout.readline().strip(), b"streaming")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        wait_for(lambda: request_count(client.stats(), "ForwardStream", "CANCELLED") >= 1,
                 "the server to see the broken stream")
        self.assertTrue(self.idle(client), client.info())
        rng = np.random.default_rng(0)
        x, w, t = problem(rng)
        fwd = client.forward(x, t, w, need_backward=True)
        client.backward(fwd.session_id)
        # The worker finishes its bookkeeping just after the reply.
        wait_for(lambda: self.idle(client), "the server to be idle again")

    def test_sessions_expire_under_load_and_the_rest_is_served(self):
        server = ServerProcess(SERVER, "--backend=cpu", "--session_ttl=1s", "--workers=2")
        self.addCleanup(server.kill)
        client = flce.Client(server.address)
        errors, abandoned, completed = [], [0], [0]
        lock = threading.Lock()

        def worker(seed, abandon):
            rng = np.random.default_rng(seed)
            local = flce.Client(server.address)
            try:
                for _ in range(15):
                    x, w, t = problem(rng, n=32, h=16, v=200)
                    fwd = local.forward(x, t, w, need_backward=True)
                    if abandon:
                        with lock:
                            abandoned[0] += 1
                        continue
                    local.backward(fwd.session_id)
                    with lock:
                        completed[0] += 1
            except flce.FlceError as e:
                with lock:
                    errors.append(str(e))
            finally:
                local.close()

        threads = [threading.Thread(target=worker, args=(i, i % 2 == 0)) for i in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        self.assertEqual(errors, [])
        self.assertEqual(completed[0], 4 * 15)
        # The reaper frees every abandoned session once its TTL has passed.
        wait_for(lambda: self.idle(client), "abandoned sessions to expire", timeout=30)
        self.assertGreaterEqual(client.stats().sessions_expired, abandoned[0])

    def test_sigterm_lets_work_in_flight_finish_then_exits_zero(self):
        server = ServerProcess(SERVER, "--backend=cpu", "--shutdown_grace=60s", "--workers=1")
        client = flce.Client(server.address, timeout=120)
        rng = np.random.default_rng(1)
        x, w, t = problem(rng, n=2048, h=1024, v=16000)
        result = {}

        def long_forward():
            try:
                result["fwd"] = client.forward(x, t, w)
            except flce.FlceError as e:
                result["error"] = e

        th = threading.Thread(target=long_forward)
        th.start()
        wait_for(lambda: client.info().running_requests == 1, "the Forward to start")
        server.process.send_signal(signal.SIGTERM)
        th.join()
        self.assertNotIn("error", result)
        self.assertTrue(np.isfinite(flce.from_wire(result["fwd"].loss)).all())
        self.assertEqual(server.process.wait(timeout=60), 0)
        self.assertIn("shutdown: done", server.read_log())
        with self.assertRaises(flce.FlceError) as e:
            flce.Client(server.address, timeout=5).info()
        self.assertEqual(e.exception.code, grpc.StatusCode.UNAVAILABLE)

    def test_sigterm_ends_open_health_watches_and_does_not_wait_for_them(self):
        # A Watch never ends by itself: the server must end it (NOT_SERVING,
        # then UNAVAILABLE) or SIGTERM would wait out the whole grace.
        server = ServerProcess(SERVER, "--backend=cpu", "--shutdown_grace=120s",
                               "--max_health_watches=2")
        self.addCleanup(server.kill)
        channel = grpc.insecure_channel(server.address)
        self.addCleanup(channel.close)
        watch = channel.unary_stream("/grpc.health.v1.Health/Watch")
        # HealthCheckResponse on the wire: field 1 = SERVING (1) or NOT_SERVING (2).
        serving, not_serving = b"\x08\x01", b"\x08\x02"
        first, second = watch(b""), watch(b"")
        self.assertEqual(next(first), serving)
        self.assertEqual(next(second), serving)
        with self.assertRaises(grpc.RpcError) as e:
            next(watch(b""))
        self.assertEqual(e.exception.code(), grpc.StatusCode.RESOURCE_EXHAUSTED)
        self.assertIn("--max_health_watches", e.exception.details())
        second.cancel()  # a watch ended by its client frees its place
        wait_for(lambda: self._watch_opens(watch), "a freed watch place")
        start = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        self.assertEqual(next(first), not_serving)
        with self.assertRaises(grpc.RpcError) as e:
            next(first)
        self.assertEqual(e.exception.code(), grpc.StatusCode.UNAVAILABLE)
        self.assertEqual(server.process.wait(timeout=60), 0)
        self.assertLess(time.monotonic() - start, 30)  # the grace is 120 s
        self.assertIn("shutdown: done", server.read_log())

    def _watch_opens(self, watch):
        call = watch(b"")
        try:
            next(call)
            return True
        except grpc.RpcError as e:
            self.assertEqual(e.code(), grpc.StatusCode.RESOURCE_EXHAUSTED)
            return False
        finally:
            call.cancel()

    def test_python_client_over_tls_with_a_token(self):
        tokens = os.path.join(os.environ.get("TEST_TMPDIR", "/tmp"), "tokens")
        with open(tokens, "w") as f:
            f.write("carol token-carol\n")
        server = ServerProcess(SERVER, "--backend=cpu", *tls_flags(CERTS, "server"),
                               "--auth_tokens_file=" + tokens, tls=True)
        self.addCleanup(server.kill)
        with open(os.path.join(CERTS, "ca.crt"), "rb") as f:
            ca = f.read()
        good = flce.Client(server.address, root_certificates=ca, token="token-carol")
        rng = np.random.default_rng(2)
        x, w, t = problem(rng)
        fwd = good.forward(x, t, w, need_backward=True)
        grads = good.backward(fwd.session_id)
        self.assertEqual(tuple(grads.grad_hidden.shape), x.shape)
        with self.assertRaises(flce.FlceError) as e:
            flce.Client(server.address, root_certificates=ca, token="nope").info()
        self.assertEqual(e.exception.code, grpc.StatusCode.UNAUTHENTICATED)
        with self.assertRaises(flce.FlceError) as e:
            flce.Client(server.address, timeout=5).info()  # plaintext to a TLS port
        self.assertEqual(e.exception.code, grpc.StatusCode.UNAVAILABLE)

    def test_python_client_dials_by_ip_with_a_server_name(self):
        # The certificate names flce.ml.svc (and *.flce.ml.svc) only.
        server = ServerProcess(SERVER, "--backend=cpu", *tls_flags(CERTS, "service_server"),
                               tls=True)
        self.addCleanup(server.kill)
        with open(os.path.join(CERTS, "service_ca.crt"), "rb") as f:
            ca = f.read()
        with self.assertRaises(flce.FlceError) as e:
            flce.Client(server.address, timeout=5, root_certificates=ca).info()
        self.assertEqual(e.exception.code, grpc.StatusCode.UNAVAILABLE)
        client = flce.Client(server.address, root_certificates=ca, server_name="flce.ml.svc")
        self.addCleanup(client.close)
        x, w, t = problem(np.random.default_rng(3))
        self.assertEqual(client.forward(x, t, w).num_valid, len(t))


if __name__ == "__main__":
    sys.exit(run_tests(FaultTest, "fault"))
