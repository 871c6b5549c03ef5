"""Weights and their gradients over several connections (flce/bulk.py)
against a real flce_server: the same bytes as over one stream, into the
caller's buffers, the fallback where the server offers no region, and
the parts' encoding.

Run by Bazel (tests/BUILD) with the path of flce_server as the argument.
"""

import socket
import sys
import threading
import time
import unittest
import zlib
from unittest import mock

import grpc
import numpy as np
import torch

import flce
from flce import bulk, bulk_http
from server_process import ServerProcess, run_tests

SERVER = sys.argv[1]


def count_streams(server, rpc):
    return server.read_log().count(f"rpc={rpc} ")


def settled_count(server, rpc):
    """count_streams once no access line of `rpc` came for 0.2 s (a
    request's line is written after its answer went out)."""
    last = count_streams(server, rpc)
    while True:
        time.sleep(0.2)
        now = count_streams(server, rpc)
        if now == last:
            return now
        last = now


class BulkTransferTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = ServerProcess(SERVER, "--backend=cpu", "--max_message_bytes=8MiB")

    @classmethod
    def tearDownClass(cls):
        cls.server.kill()

    def client(self, **kwargs):
        c = flce.Client(self.server.address, max_message_bytes=8 << 20, **kwargs)
        self.addCleanup(c.close)
        return c

    def accumulate(self, c, name, x, t):
        fwd = c.forward(x, t, weight_name=name, need_backward=True)
        c.backward(fwd.session_id, accumulate_weight_grad=True)
        return flce.from_wire(fwd.loss)

    def test_a_weight_and_its_gradient_over_several_connections_equal_one_stream(self):
        r = np.random.default_rng(1)
        w = (r.standard_normal((6001, 333)) / 20).astype(np.float32)  # 8 MB: over the limit
        b = r.standard_normal(6001).astype(np.float32)
        x = r.standard_normal((37, 333)).astype(np.float32)
        t = r.integers(0, 6001, 37)
        results = []
        rpcs = ("WriteRegion", "ReadRegion", "BulkWrite", "BulkRead")
        for connections, http in ((0, True), (3, True), (3, False)):
            c = self.client(bulk_connections=connections, bulk_threshold=1 << 20, bulk_http=http)
            before = [settled_count(self.server, rpc) for rpc in rpcs]
            name = f"w{connections}{http}"
            info = c.put_weight(name, w, b)
            self.assertEqual(info.bytes, w.nbytes + b.nbytes)
            loss = self.accumulate(c, name, x, t)
            dw, db, count = c.take_weight_grad(name)
            self.assertEqual(count, 1)
            used = tuple(settled_count(self.server, rpc) - n for rpc, n in zip(rpcs, before))
            # Over 3 gRPC connections: W's two parts on two, b on one; the
            # same back. Over the bulk port: W's 8 MB in 3 ranges, b in one.
            self.assertEqual(used, {0: (0, 0, 0, 0), 3: (0, 0, 4, 4) if http else (3, 3, 0, 0)}[
                connections])
            results.append((loss.tobytes(), dw.data, db.data))
        self.assertEqual(results[0], results[1])
        self.assertEqual(results[0], results[2])

    def test_gradients_land_in_the_callers_buffers(self):
        torch.manual_seed(2)
        w = torch.randn(4099, 257).to(torch.bfloat16)
        x = torch.randn(19, 257).to(torch.bfloat16)
        t = torch.randint(0, 4099, (19,))
        for connections in (0, 2):
            c = self.client(bulk_connections=connections, bulk_threshold=1 << 20)
            c.put_weight("bf", w)
            self.accumulate(c, "bf", x, t)
            out = torch.full((4099, 257), float("nan"), dtype=torch.bfloat16)
            got, none, _ = c.take_weight_grad("bf", float32=False, out=(out, None))
            self.assertIs(got, out)
            self.assertIsNone(none)
            self.assertTrue(torch.isfinite(out.float()).all())
            self.accumulate(c, "bf", x, t)
            dw, _, _ = c.take_weight_grad("bf", float32=False)
            self.assertEqual(dw.dtype, flce.client.pb.DTYPE_BFLOAT16)
            self.assertEqual(out.view(torch.int16).numpy().tobytes(), dw.data)
            # A buffer of the wrong size is refused before anything is taken.
            self.accumulate(c, "bf", x, t)
            with self.assertRaises(ValueError):
                c.take_weight_grad("bf", float32=False, out=(torch.empty(3), None))
            _, _, count = c.take_weight_grad("bf")
            self.assertEqual(count, 1)

    def test_a_transfer_below_64_mib_uses_at_most_4_connections(self):
        # A row piece's 16 MiB in 4 ranges, a 64 MiB weight over all 8
        # connections: over the bulk port and over gRPC streams alike.
        for http in (True, False):
            c = self.client(bulk_connections=8, bulk_threshold=1 << 20, bulk_http=http)
            transfer = c.bulk(64 << 20)
            region = transfer.region(64 << 20)
            self.assertEqual(transfer.over_http, http)
            rpc = "BulkWrite" if http else "WriteRegion"
            used = []
            for size in (16 << 20, 64 << 20):
                data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
                before = settled_count(self.server, rpc)
                transfer.write(region, 0, data, 60.0)
                used.append(settled_count(self.server, rpc) - before)
                back = np.zeros_like(data)
                transfer.read(region, 0, back, 60.0)
                self.assertTrue(np.array_equal(back, data))
            self.assertEqual(used, [4, 8], f"over {rpc}")

    def test_each_range_is_handed_over_as_it_goes_and_as_it_lands(self):
        # A row piece's copy off the GPU range by range: each range's bytes
        # are made in `before` and must be what goes; `landed` must see its
        # range's bytes already here. Over the bulk port (3 ranges of 2 MiB)
        # and over gRPC (the whole at once).
        size = 6 << 20
        want = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
        for http in (True, False):
            c = self.client(bulk_connections=4, bulk_threshold=1 << 20, bulk_http=http)
            transfer = c.bulk(size)
            region = transfer.region(size)
            spans = transfer.spans(size)
            self.assertEqual(len(spans), 3 if http else 1)
            data = np.zeros_like(want)
            made, seen = [], []

            def before(span):
                data[span.start:span.stop] = want[span.start:span.stop]
                made.append((span.start, span.stop))

            transfer.write(region, 0, data, 60.0, before)
            back = np.zeros_like(want)

            def landed(span):
                seen.append((span.start, span.stop,
                             np.array_equal(back[span.start:span.stop],
                                            want[span.start:span.stop])))

            transfer.read(region, 0, back, 60.0, landed)
            self.assertTrue(np.array_equal(back, want), f"http={http}")
            expected = [(r.start, r.stop) for r in spans]
            self.assertEqual(sorted(made), expected)
            self.assertEqual(sorted(seen), [(a, b, True) for a, b in expected])

    def test_a_read_after_a_mark_waits_for_the_forward_that_posts_it(self):
        c = self.client(bulk_connections=2, bulk_threshold=1 << 10)
        transfer = c.bulk(1 << 20)
        region = transfer.region(1 << 20)
        self.assertTrue(transfer.marks and transfer.over_http)
        # A mark no call posts: the read waits until cancelled; the server
        # serves on.
        cancel = bulk_http.Cancel()
        out = np.zeros(4096, dtype=np.uint8)
        result = []

        def read():
            try:
                transfer.read_marked(region, 0, out, transfer.next_mark(), 60.0, cancel)
            except flce.FlceError as e:
                result.append(e.code)

        reader = threading.Thread(target=read)
        reader.start()
        time.sleep(0.2)
        self.assertTrue(reader.is_alive())
        cancel.cancel()
        reader.join(10)
        self.assertEqual(result, [grpc.StatusCode.CANCELLED])
        transfer.read(region, 0, out, 10.0)
        # A Forward that writes dX into the region posts its mark: the read
        # sent before it gets that dX; a Forward that fails posts ABORTED.
        torch.manual_seed(4)
        w, x, t = torch.randn(301, 17) / 4, torch.randn(13, 17), torch.randint(0, 301, (13,))
        c.put_weight("marked", w)
        transfer.write(region, 0, x.numpy(), 10.0)
        for target, code in ((t, None), (torch.full((13,), 5000), grpc.StatusCode.ABORTED)):
            mark = transfer.next_mark()
            r = flce.client.pb.ForwardRequest(need_backward=True)
            r.weight_ref.name = "marked"
            r.hidden.dtype = flce.client.pb.DTYPE_FLOAT32
            r.hidden.shape.extend([13, 17])
            r.hidden.shm.region_id = region
            r.backward.gradients = flce.client.pb.GRADIENTS_HIDDEN
            r.backward.grad_hidden_out.region_id = region
            r.backward.grad_hidden_out.offset = 8192
            r.backward.written_mark = mark
            flce.to_wire(target, r.target)
            dx = np.zeros((13, 17), dtype=np.float32)
            got = []
            reader = threading.Thread(target=lambda: got.append(self.marked_read(
                transfer, region, dx, mark)))
            reader.start()
            time.sleep(0.1)
            call = c._stub.Forward.future(r, timeout=30, metadata=c._metadata)
            reader.join(30)
            if code is None:
                self.assertEqual(got, [None])
                call.result()
                xr = x.clone().requires_grad_()
                torch.nn.functional.cross_entropy(xr @ w.T, t).backward()
                np.testing.assert_allclose(dx, xr.grad.numpy(), rtol=1e-4, atol=1e-6)
            else:
                self.assertEqual(got, [code])
                with self.assertRaises(grpc.RpcError) as e:
                    call.result()
                self.assertEqual(e.exception.code(), grpc.StatusCode.OUT_OF_RANGE)

    @staticmethod
    def marked_read(transfer, region, dx, mark):
        try:
            transfer.read_marked(region, 8192, dx, mark, 30.0, bulk_http.Cancel())
        except flce.FlceError as e:
            return e.code
        return None

    def test_a_written_mark_needs_dx_in_a_region_of_server_memory(self):
        c = self.client(bulk_connections=2, bulk_threshold=1 << 10)
        c.put_weight("wm", np.ones((5, 3), dtype=np.float32))
        for region_id in ("no-such-region", None):
            r = flce.client.pb.ForwardRequest(need_backward=True)
            r.weight_ref.name = "wm"
            flce.to_wire(np.ones((2, 3), dtype=np.float32), r.hidden)
            flce.to_wire(np.zeros(2, dtype=np.int64), r.target)
            r.backward.written_mark = 1
            if region_id is not None:
                r.backward.gradients = flce.client.pb.GRADIENTS_HIDDEN
                r.backward.grad_hidden_out.region_id = region_id
            with self.assertRaises(grpc.RpcError) as e:
                c._stub.Forward(r, timeout=10, metadata=c._metadata)
            self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn("backward.written_mark", e.exception.details())
        # The server serves on.
        c.forward(np.ones((2, 3), dtype=np.float32), np.zeros(2, dtype=np.int64), weight_name="wm")

    def test_without_regions_the_one_stream_serves(self):
        server = ServerProcess(SERVER, "--backend=cpu", "--region_memory_bytes=0")
        self.addCleanup(server.kill)
        c = flce.Client(server.address, bulk_threshold=1 << 10)
        self.addCleanup(c.close)
        w = np.ones((300, 40), np.float32)
        self.assertEqual(c.put_weight("w", w).version, 1)
        self.assertNotIn("rpc=WriteRegion", server.read_log())
        self.assertIn("--region_memory_bytes", server.read_log())

    def test_a_name_of_several_servers_is_pinned_to_the_one_holding_the_region(self):
        # A headless Service's name resolves to every pod; the region lives
        # on the pod the gRPC channel reached. Here: two servers whose bulk
        # ports share a number on two loopback addresses, and a name that
        # resolves to the other one first.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mine = ServerProcess(SERVER, "--backend=cpu", f"--bulk_address=127.0.0.1:{port}")
        self.addCleanup(mine.kill)
        other = ServerProcess(SERVER, "--backend=cpu", f"--bulk_address=127.0.0.2:{port}")
        self.addCleanup(other.kill)
        c = flce.Client(mine.address, bulk_threshold=1 << 10)
        self.addCleanup(c.close)
        c._bulk_http_where = ("flce.pods.test", None, "flce.pods.test")
        resolve = socket.getaddrinfo

        def pods(host, *args, **kwargs):
            if host != "flce.pods.test":
                return resolve(host, *args, **kwargs)
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port))
                    for ip in ("127.0.0.2", "127.0.0.1")]

        w = np.random.default_rng(3).standard_normal((700, 64)).astype(np.float32)
        with mock.patch("socket.getaddrinfo", pods):
            c.put_weight("w", w)
            self.assertTrue(c.bulk(w.nbytes).over_http)
        # (A request's access line is written just after its answer went out.)
        deadline = time.monotonic() + 10
        while ("rpc=BulkWrite via=http" not in mine.read_log()
               and time.monotonic() < deadline):
            time.sleep(0.02)
        self.assertRegex(mine.read_log(), r"rpc=BulkWrite via=http .*code=OK")
        self.assertNotRegex(other.read_log(), r"rpc=Bulk\w+ via=http .*code=OK")
        self.assertRegex(other.read_log(), r"rpc=BulkRead via=http .*code=NOT_FOUND")

    def test_a_bulk_port_that_stalls_fails_the_transfer_within_its_timeout(self):
        # The client's sockets block with the kernel's timeouts (one system
        # call a body): a port that stops sending, never answers or never
        # reads must still end the transfer, by name, after the timeout.
        listener = socket.create_server(("127.0.0.1", 0))
        self.addCleanup(listener.close)
        held = []

        def serve():
            for answer in (b"HTTP/1.1 200 OK\r\nContent-Length: 1048576\r\n"
                           b"Flce-Code: 0\r\n\r\n" + b"x" * 1000, b"", None):
                conn, _ = listener.accept()
                held.append(conn)
                if answer is not None:  # (None: reads nothing)
                    conn.recv(65536)
                    conn.sendall(answer)

        threading.Thread(target=serve, daemon=True).start()
        port = bulk_http.BulkHttp("127.0.0.1", listener.getsockname()[1], timeout=0.5,
                                  max_connections=1)
        self.addCleanup(port.close)
        out = bytearray(1 << 20)
        for expected in ("1000 of 1048576 bytes arrived: no bytes for 0.5 s",
                         "the connection broke: no answer for 0.5 s"):
            start = time.monotonic()
            with self.assertRaises(flce.FlceError) as e:
                port.get("r", "ticket", 0, memoryview(out))
            self.assertLess(time.monotonic() - start, 5)
            self.assertEqual(e.exception.code, grpc.StatusCode.UNAVAILABLE)
            self.assertIn(expected, str(e.exception))
        self.assertEqual(bytes(out[:1000]), b"x" * 1000)
        start = time.monotonic()
        with self.assertRaises(flce.FlceError) as e:
            port.put("r", "ticket", 0, memoryview(bytearray(64 << 20)))
        self.assertLess(time.monotonic() - start, 5)
        self.assertEqual(e.exception.code, grpc.StatusCode.UNAVAILABLE)
        self.assertIn("the connection broke: sending stalled for 0.5 s", str(e.exception))
        for conn in held:
            conn.close()

    def test_parts_round_trip_and_a_bad_crc_is_refused(self):
        data = bytes(range(256)) * 300
        encoded = bulk.encode_part("abc", 12345, memoryview(data))
        part = flce.client.pb.RegionPart.FromString(encoded)
        self.assertEqual((part.region_id, part.offset, part.data, part.crc32),
                         ("abc", 12345, data, zlib.crc32(data)))
        offset, crc, view = bulk.decode_part(part.SerializeToString())
        self.assertEqual((offset, crc, bytes(view)), (12345, zlib.crc32(data), data))
        c = self.client()
        region = c._call(c._stub.RegisterSharedMemory, flce.client.pb.RegisterSharedMemoryRequest(
            server_memory=True, bytes=1 << 20)).region_id
        bad = bytearray(bulk.encode_part(region, 0, memoryview(data)))
        bad[-1] ^= 1
        write = c._channel.stream_unary("/flce.v1.LossService/WriteRegion")
        with self.assertRaises(grpc.RpcError) as e:
            write(iter([bytes(bad)]), timeout=30)
        self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("crc32", e.exception.details())
        self.assertTrue(c.info().version)


if __name__ == "__main__":
    sys.exit(run_tests(BulkTransferTest, "BulkTransferTest"))
