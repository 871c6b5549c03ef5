"""flce across hosts: a server and a worker in two network namespaces joined by
a veth pair, real TCP with TLS and a bearer token.

- A short training loop (a tiny LM, gradient accumulation, an optimizer,
  the head's weight registered and its gradients summed on the server, each
  micro-batch in row pieces over the bulk connections) run
  by the worker in its namespace must equal the same loop computed locally,
  step for step.
- The link dropped in the middle of a 96 MiB PutWeight: the worker gets a
  clear error, the server keeps nothing of the upload (no weight, no budget
  held), and once the link is back the retry succeeds.

Needs root (ip netns, tc from iproute2); skips without. Run by Bazel
(tests/BUILD) with the path of flce_server as the argument.
"""

import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
import unittest

import flce
from server_process import ServerProcess, run_tests, tls_flags, wait_for

SERVER = sys.argv[1]
SRCDIR = os.path.join(os.environ.get("TEST_SRCDIR", "."), "flce")
CERTS = os.path.join(SRCDIR, "tests", "testdata", "tls")
PYTHONPATH = os.environ.get("PYTHONPATH", "")
TOKEN = "netns-test-token"
# iproute2's ip and tc live in /usr/sbin, which a test's PATH may lack.
IP = shutil.which("ip") or "/usr/sbin/ip"
TC = shutil.which("tc") or "/usr/sbin/tc"


def sh(*args, check=True):
    result = subprocess.run(args, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: exit {result.returncode}: {result.stderr.strip()}")
    return result


def netns_usable():
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    probe = f"flce-probe-{os.getpid()}"
    result = sh(IP, "netns", "add", probe, check=False)
    if result.returncode != 0:
        return "ip netns add failed: " + result.stderr.strip()
    sh(IP, "netns", "delete", probe, check=False)
    return None


class Link:
    """Two namespaces, `server` and `worker`, joined by a veth pair with
    10.231.<k>.1 (server) and .2 (worker)."""

    def __init__(self):
        tag = os.getpid() % 100000
        self.server_ns, self.worker_ns = f"flce-s{tag}", f"flce-w{tag}"
        self.server_if, self.worker_if = f"fs{tag}", f"fw{tag}"
        k = tag % 250 + 1
        self.server_ip, self.worker_ip = f"10.231.{k}.1", f"10.231.{k}.2"
        for ns in (self.server_ns, self.worker_ns):
            sh(IP, "netns", "add", ns)
            sh(IP, "-n", ns, "link", "set", "lo", "up")
        sh(IP, "link", "add", self.server_if, "netns", self.server_ns, "type", "veth",
           "peer", "name", self.worker_if, "netns", self.worker_ns)
        for ns, dev, ip in ((self.server_ns, self.server_if, self.server_ip),
                            (self.worker_ns, self.worker_if, self.worker_ip)):
            sh(IP, "-n", ns, "addr", "add", f"{ip}/30", "dev", dev)
            sh(IP, "-n", ns, "link", "set", dev, "up")

    def set_up(self, up):
        sh(IP, "-n", self.worker_ns, "link", "set", self.worker_if, "up" if up else "down")

    def throttle(self, rate):
        """Limits what the worker sends (tc tbf), or lifts the limit (None)."""
        sh(IP, "netns", "exec", self.worker_ns, TC, "qdisc", "del", "dev", self.worker_if,
           "root", check=False)
        if rate:
            sh(IP, "netns", "exec", self.worker_ns, TC, "qdisc", "add", "dev",
               self.worker_if, "root", "tbf", "rate", rate, "burst", "256kb", "latency", "400ms")

    def worker(self, script):
        """Runs Python `script` in the worker's namespace; its process."""
        env = dict(os.environ, PYTHONPATH=PYTHONPATH)
        return subprocess.Popen([IP, "netns", "exec", self.worker_ns, sys.executable, "-c",
                                 script], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    def close(self):
        for ns in (self.server_ns, self.worker_ns):
            sh(IP, "netns", "delete", ns, check=False)


class NetnsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        why = netns_usable()
        if why:
            raise unittest.SkipTest(why)
        cls.link = Link()
        tmp = os.environ.get("TEST_TMPDIR", "/tmp")
        cls.tokens = os.path.join(tmp, "netns-tokens")
        with open(cls.tokens, "w") as f:
            f.write(f"trainer {TOKEN}\n")
        cls.server = ServerProcess(
            SERVER, "--backend=cpu", *tls_flags(CERTS, "service_server"),
            f"--auth_tokens_file={cls.tokens}", "--stream_idle_timeout=3s",
            f"--weight_memory_bytes={512 << 20}", tls=True, host=cls.link.server_ip,
            prefix=(IP, "netns", "exec", cls.link.server_ns))

    @classmethod
    def tearDownClass(cls):
        if hasattr(cls, "server"):
            cls.server.kill()
        if hasattr(cls, "link"):
            cls.link.close()

    def run_worker(self, body, timeout=300):
        script = textwrap.dedent(f"""
            import sys
            import flce
            ca = open({os.path.join(CERTS, 'service_ca.crt')!r}, 'rb').read()
            client = flce.Client({self.server.address!r}, root_certificates=ca,
                                 server_name="flce.ml.svc", token={TOKEN!r}, timeout=20,
                                 bulk_threshold=1 << 10)
        """) + textwrap.dedent(body)
        process = self.link.worker(script)
        out, _ = process.communicate(timeout=timeout)
        return process.returncode, out

    def test_a_training_loop_across_hosts_equals_the_local_one(self):
        tiny_lm = os.path.join(SRCDIR, "client", "python", "examples")
        code, out = self.run_worker(f"""
            import copy
            import torch
            import torch.nn.functional as F
            sys.path.insert(0, {tiny_lm!r})
            from train_tiny_lm import TinyLM

            def rel(a, b):
                return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))

            torch.manual_seed(0)
            local = TinyLM(vocab=61, hidden=24)
            remote = copy.deepcopy(local)
            # Row pieces over the bulk connections even for these small batches.
            loss_fn = flce.RemoteLinearCrossEntropy(client, label_smoothing=0.1,
                                                    pipeline_min_piece_bytes=256)
            opt_local = torch.optim.AdamW(local.parameters(), lr=1e-2)
            opt_remote = torch.optim.AdamW(remote.parameters(), lr=1e-2)
            loss_fn.attach(opt_remote)
            gen = torch.Generator().manual_seed(1)
            for step in range(3):
                opt_local.zero_grad()
                opt_remote.zero_grad()
                for micro in range(2):
                    tokens = torch.randint(0, 61, (4, 9), generator=gen)
                    targets = torch.randint(0, 61, (4, 9), generator=gen)
                    ref = F.cross_entropy(local.head(local.hidden_states(tokens)).reshape(-1, 61),
                                          targets.reshape(-1), label_smoothing=0.1) / 2
                    ref.backward()
                    loss = loss_fn(remote.hidden_states(tokens), remote.head.weight, targets,
                                   remote.head.bias) / 2
                    loss.backward()
                    assert type(loss_fn._last).__name__ == "PipelinedStep"
                    assert rel(loss.detach(), ref.detach()) < 1e-5, (step, micro)
                opt_local.step()
                opt_remote.step()
                for (name, a), (_, b) in zip(local.named_parameters(), remote.named_parameters()):
                    assert rel(b.detach(), a.detach()) < 1e-5, (name, step)
                print("step", step, "equal")
            assert loss_fn._registration.puts == 3  # W sent once per optimizer step
            loss_fn.close()
            print("OK")
        """)
        self.assertEqual(code, 0, out)
        self.assertIn("OK", out)
        # X, dX and the weights moved over the bulk port, with TLS.
        log = self.server.read_log()
        self.assertIn("bulk transfers over HTTPS", log)
        self.assertRegex(log, r"rpc=BulkWrite via=http .*code=OK")
        self.assertRegex(log, r"rpc=BulkRead via=http .*code=OK")

    def test_a_link_dropped_mid_upload_keeps_nothing_and_the_retry_succeeds(self):
        self.link.throttle("80mbit")  # 96 MiB take ~10 s: the drop lands mid-upload
        self.addCleanup(self.link.throttle, None)
        self.addCleanup(self.link.set_up, True)
        process = self.link.worker(textwrap.dedent(f"""
            import sys, numpy as np
            import flce
            ca = open({os.path.join(CERTS, 'service_ca.crt')!r}, 'rb').read()
            client = flce.Client({self.server.address!r}, root_certificates=ca,
                                 server_name="flce.ml.svc", token={TOKEN!r}, timeout=15)
            import os
            client.info()  # connected (TLS done) before the upload starts
            w = np.ones((24576, 1024), np.float32)  # 96 MiB
            print("uploading", flush=True)
            try:
                client.put_weight("dropped", w)
                print("no error", flush=True)
            except flce.FlceError as e:
                print("error", e.code.name, flush=True)
            # Not the interpreter's exit: gRPC's threads may wait there on the
            # dead connection.
            os._exit(0)
        """))
        self.assertEqual(process.stdout.readline().strip(), "uploading")
        time.sleep(2.0)
        self.link.set_up(False)
        out, _ = process.communicate(timeout=60)
        self.assertRegex(out, r"error (UNAVAILABLE|DEADLINE_EXCEEDED)", out)
        # The server gave the cut transfer up (its idle timeout) and says so.
        wait_for(lambda: re.search(r"rpc=BulkWrite via=http .*code=CANCELLED",
                                   self.server.read_log()), "the cut BulkWrite")
        self.link.set_up(True)
        self.link.throttle(None)
        # Nothing half-applied: once the server has given the stalled upload
        # up (its idle timeout), no weight and no budget is held.
        code, out = self.run_worker("""
            import time
            for _ in range(200):
                stats = client.stats()
                if stats.weight_memory_bytes == 0 and stats.open_streams == 0:
                    break
                time.sleep(0.1)
            assert stats.weight_memory_bytes == 0, stats.weight_memory_bytes
            assert [w.name for w in client.list_weights()] == [], client.list_weights()
            import numpy as np
            info = client.put_weight("dropped", np.ones((24576, 1024), np.float32))
            assert info.version == 1 and info.bytes == 24576 * 1024 * 4, info
            client.delete_weight("dropped")
            print("OK")
        """)
        self.assertEqual(code, 0, out)
        self.assertIn("OK", out)


if __name__ == "__main__":
    sys.exit(run_tests(NetnsTest, "netns"))
