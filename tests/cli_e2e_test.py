"""End to end: the real flce_server binary and the real `flce` CLI.

Starts flce_server on a free loopback port, then drives it with the CLI the
way a user would: --help, --version and flag values, health, info, stats,
the smoke matrix, and forward/backward on .npy files checked against a
NumPy float64 computation written here independently of the C++ reference,
TLS with a server-name override. Ends with SIGTERM and a clean exit.

Run by Bazel (tests/BUILD) with the two binaries' paths as arguments.
"""

import os
import re
import signal
import subprocess
import sys
import tempfile
import unittest
import numpy as np

from server_process import ServerProcess, run_tests, tls_flags

SERVER, CLI = sys.argv[1], sys.argv[2]
CERTS = os.path.join(os.environ.get("TEST_SRCDIR", "."), "flce", "tests", "testdata", "tls")


def softmax_ce_reference(x, w, b, t, ignore_index, smoothing, reduction):
    """PyTorch's cross_entropy(x @ w.T + b, t, ...) and its gradients, float64."""
    z = x @ w.T + b
    m = z.max(axis=1, keepdims=True)
    lse = (m + np.log(np.exp(z - m).sum(axis=1, keepdims=True)))[:, 0]
    p = np.exp(z - lse[:, None])
    n, v = z.shape
    valid = t != ignore_index
    tt = np.where(valid, t, 0)
    nll = lse - z[np.arange(n), tt]
    smooth = v * lse - z.sum(axis=1)
    rows = np.where(valid, (1 - smoothing) * nll + smoothing / v * smooth, 0.0)
    denom = valid.sum() if reduction == "mean" else 1.0
    dz = (p - (1 - smoothing) * np.eye(v)[tt] - smoothing / v) * valid[:, None] / denom
    loss = rows.sum() / denom if reduction != "none" else rows
    return loss, lse, dz @ w, dz.T @ x, dz.sum(axis=0)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300)


class CliEndToEndTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
        cls.server = ServerProcess(SERVER, "--backend=auto", "--session_ttl=60s",
                                   "--session_memory_bytes=2GiB",
                                   "--health_address=127.0.0.1:0")
        cls.address = cls.server.address

    @classmethod
    def tearDownClass(cls):
        cls.server.kill()

    def flce(self, *args, check=True):
        result = subprocess.run([CLI, "--server=" + self.address, *args],
                                capture_output=True, text=True, timeout=300)
        if check and result.returncode != 0:
            self.fail("flce %s failed (%d):\n%s%s" % (" ".join(args), result.returncode,
                                                      result.stdout, result.stderr))
        return result

    def run_binary(self, binary, *args):
        return subprocess.run([binary, *args], capture_output=True, text=True, timeout=60)

    def test_0_help_lists_the_flags_and_exits_0(self):
        # Every engine option (CpuEngineOptions, CudaEngineOptions) has its flag.
        engine_flags = ["--cpu_chunk_bytes", "--cpu_workspace_cache_bytes", "--cuda_device",
                        "--cuda_lanes", "--cuda_chunk_bytes", "--cuda_min_slice_columns",
                        "--cuda_tune_gemms", "--cuda_one_pass_rows",
                        "--cuda_keep_chunk_logits", "--cuda_hopper_gemms"]
        for binary, flags in [(SERVER, ["--listen_address", "--health_address",
                                        "--drain_timeout", "--session_memory_bytes"] +
                               engine_flags),
                              (CLI, ["--server", "--tls_server_name", "--dtype", "--raw"])]:
            for ask in ("--help", "-help") + (("-h",) if binary == SERVER else ()):
                result = self.run_binary(binary, ask)
                self.assertEqual(result.returncode, 0, result.stderr)
                self.assertNotIn("No flags matched", result.stdout)
                for flag in flags:
                    self.assertIn(flag + "  (default", result.stdout, (binary, flag))
            version = self.run_binary(binary, "--version")
            self.assertEqual(version.returncode, 0)
            self.assertRegex(version.stdout, r"^flce(_server)? \d+\.\d+\.\d+\n$")
        self.assertIn("commands:", self.run_binary(CLI, "--help").stdout)

    def test_0_flag_values_name_their_forms(self):
        for args, form in [(["--session_ttl=600"], "e.g. 600s, 10m"),
                           (["--session_memory_bytes=16G"], "e.g. 17179869184, 16GiB"),
                           (["--max_message_bytes=lots"], "e.g. 17179869184, 16GiB")]:
            result = self.run_binary(SERVER, "--insecure", *args)
            self.assertNotEqual(result.returncode, 0)
            self.assertIn(form, result.stderr, args)
        result = self.run_binary(SERVER, "--insecure", "--cuda_hopper_gemms=dx,logit")
        self.assertEqual(result.returncode, 2)
        self.assertIn("--cuda_hopper_gemms: 'logit' is not one of logits, dx, dw", result.stderr)
        result = self.run_binary(CLI, "--timeout=5", "health")
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("'5' has no unit", result.stderr)
        bad = self.flce("smoke", "--dtype=bfloat17", check=False)
        self.assertEqual(bad.returncode, 1)
        self.assertIn("choose bf16, fp16 or fp32", bad.stderr)
        self.assertIn("choose mean, sum or none",
                      self.flce("smoke", "--reduction=avg", check=False).stderr)

    def test_1_health_and_info(self):
        self.assertIn("SERVING", self.flce("health").stdout)
        info = self.flce("info").stdout
        self.assertRegex(info, r"backend\s+cpu")
        self.assertRegex(info, r"max_sessions\s+1024")
        self.assertRegex(info, r"session_memory\s+2147483648 bytes")  # --session_memory_bytes=2GiB
        # The health-only port answers health, and says what it is to anything else.
        port = re.search(r"health \(grpc.health.v1 only, plaintext\) on port (\d+)",
                         self.server.read_log()).group(1)
        health_port = subprocess.run([CLI, "--server=127.0.0.1:" + port, "health"],
                                     capture_output=True, text=True, timeout=60)
        self.assertIn("SERVING", health_port.stdout)
        wrong = subprocess.run([CLI, "--server=127.0.0.1:" + port, "info"],
                               capture_output=True, text=True, timeout=60)
        self.assertEqual(wrong.returncode, 1)
        self.assertIn("UNIMPLEMENTED: this port serves only grpc.health.v1 (--health_address)",
                      wrong.stderr)

    def test_2_smoke_matrix_passes(self):
        out = self.flce("smoke", "--matrix", "--n=33", "--h=17", "--v=257").stdout
        self.assertIn("PASS: 15 passed, 0 failed", out)
        self.assertNotIn("FAIL", out)
        self.assertIn("PASS", self.flce("smoke", "--dtype=bfloat16", "--n=5").stdout)
        # The smoke runs are counted in the server's stats: a summary...
        stats = self.flce("stats").stdout
        self.assertIn("SERVING", stats)
        self.assertRegex(stats, r"\nForward +(1[6-9]|[2-9]\d) +0 +[\d.]+ ms")
        self.assertRegex(stats, r"\nBackward +(1[6-9]|[2-9]\d) +0 ")
        self.assertRegex(stats, r"sessions +0 live")
        self.assertLess(len(stats.splitlines()), 40)
        # ... or the message.
        raw = self.flce("stats", "--raw").stdout
        self.assertRegex(raw, r'rpc: "Forward"\s+code: "OK"\s+count: (1[6-9]|[2-9]\d)')
        self.assertIn("serving: true", raw)

    def test_3_forward_backward_on_npy_files_match_numpy(self):
        rng = np.random.default_rng(5)
        n, h, v = 19, 11, 53
        x = rng.standard_normal((n, h)).astype(np.float32)
        w = (rng.standard_normal((v, h)) / np.sqrt(h)).astype(np.float32)
        b = rng.standard_normal(v).astype(np.float32)
        t = rng.integers(0, v, n).astype(np.int64)
        t[[2, 7]] = -100
        for name, a in [("x", x), ("w", w), ("b", b), ("t", t)]:
            np.save(os.path.join(self.tmp, name + ".npy"), a)
        out_dir = os.path.join(self.tmp, "out")
        os.makedirs(out_dir, exist_ok=True)
        # fp32 files are computed in fp32 (no --dtype): the 1e-5 bars below.
        fwd = self.flce("forward", "--hidden=" + self.tmp + "/x.npy",
                        "--weight=" + self.tmp + "/w.npy", "--bias_npy=" + self.tmp + "/b.npy",
                        "--target=" + self.tmp + "/t.npy", "--label_smoothing=0.1",
                        "--need_backward", "--mode=recompute", "--out=" + out_dir).stdout
        session = re.search(r"session ([0-9a-f]{32})", fwd).group(1)
        g = np.float32(1.5)
        np.save(os.path.join(self.tmp, "g.npy"), g)
        self.flce("backward", "--session=" + session, "--grad_output=" + self.tmp + "/g.npy",
                  "--out=" + out_dir)
        loss, lse, dx, dw, db = softmax_ce_reference(
            x.astype(np.float64), w.astype(np.float64), b.astype(np.float64), t, -100,
            np.float64(np.float32(0.1)), "mean")
        load = lambda name: np.load(os.path.join(out_dir, name + ".npy"))
        self.assertLess(rel_err(load("loss"), loss), 1e-5)
        self.assertLess(rel_err(load("lse"), lse), 1e-5)
        self.assertLess(rel_err(load("grad_hidden"), 1.5 * dx), 1e-5)
        self.assertLess(rel_err(load("grad_weight"), 1.5 * dw), 1e-5)
        self.assertLess(rel_err(load("grad_bias"), 1.5 * db), 1e-5)
        # The session was consumed.
        again = self.flce("backward", "--session=" + session, "--out=" + out_dir, check=False)
        self.assertNotEqual(again.returncode, 0)
        self.assertIn("FAILED_PRECONDITION", again.stderr)

    def test_3_forward_converts_to_one_dtype_and_says_so(self):
        rng = np.random.default_rng(6)
        x = rng.standard_normal((9, 8)).astype(np.float16)
        w = (rng.standard_normal((31, 8)) / 3).astype(np.float32)
        t = rng.integers(0, 31, 9).astype(np.int32)
        for name, a in [("x16", x), ("w32", w), ("t32", t)]:
            np.save(os.path.join(self.tmp, name + ".npy"), a)
        args = ["forward", "--hidden=" + self.tmp + "/x16.npy",
                "--weight=" + self.tmp + "/w32.npy", "--target=" + self.tmp + "/t32.npy",
                "--out=" + self.tmp]
        fwd = self.flce(*args)
        self.assertIn("note: --weight is fp32; sending it as fp16", fwd.stderr)
        self.assertIn("add --need_backward", fwd.stderr)
        self.assertNotIn("session", fwd.stdout)
        # --dtype converts every float input, and takes NumPy's names too.
        fwd = self.flce(*args, "--dtype=float32", "--need_backward")
        self.assertIn("note: --hidden is fp16; sending it as fp32", fwd.stderr)
        self.assertRegex(fwd.stdout, r"session [0-9a-f]{32}")
        self.assertNotIn("--need_backward", fwd.stderr)
        missing = self.flce("backward", check=False)
        self.assertIn("--session is required", missing.stderr)

    def test_4_bad_input_is_rejected_and_the_server_keeps_serving(self):
        np.save(os.path.join(self.tmp, "x5.npy"), np.zeros((3, 5), np.float32) + 1)
        np.save(os.path.join(self.tmp, "w4.npy"), np.ones((7, 4), np.float32))
        np.save(os.path.join(self.tmp, "t3.npy"), np.array([1, 2, 3], np.int64))
        bad = self.flce("forward", "--dtype=fp32", "--hidden=" + self.tmp + "/x5.npy",
                        "--weight=" + self.tmp + "/w4.npy", "--target=" + self.tmp + "/t3.npy",
                        check=False)
        self.assertNotEqual(bad.returncode, 0)
        self.assertIn("INVALID_ARGUMENT", bad.stderr)
        self.assertIn("weight:", bad.stderr)
        np.save(os.path.join(self.tmp, "t_bad.npy"), np.array([1, 9, 3], np.int64))
        np.save(os.path.join(self.tmp, "w5.npy"), np.ones((7, 5), np.float32))
        bad = self.flce("forward", "--dtype=fp32", "--hidden=" + self.tmp + "/x5.npy",
                        "--weight=" + self.tmp + "/w5.npy", "--target=" + self.tmp + "/t_bad.npy",
                        check=False)
        self.assertIn("OUT_OF_RANGE", bad.stderr)
        self.assertIn("target[1] = 9", bad.stderr)
        missing = self.flce("backward", "--session=" + "ab" * 16, check=False)
        self.assertIn("NOT_FOUND", missing.stderr)
        self.assertIn("SERVING", self.flce("health").stdout)
        # The access line of a failed call says why.
        self.assertRegex(self.server.read_log(),
                         r'rpc=Forward .*code=OUT_OF_RANGE ms=[\d.]+ error="target\[1\] = 9')

    def test_4_tls_with_a_server_name_override(self):
        # A certificate for flce.ml.svc only, dialled by IP as a worker dials a pod.
        server = ServerProcess(SERVER, "--backend=cpu", *tls_flags(CERTS, "service_server"),
                               tls=True)
        self.addCleanup(server.kill)
        ca = "--tls_ca_file=" + os.path.join(CERTS, "service_ca.crt")
        run = lambda *a: subprocess.run([CLI, "--server=" + server.address, "--timeout=10s", ca,
                                         *a], capture_output=True, text=True, timeout=60)
        refused = run("health")
        self.assertNotEqual(refused.returncode, 0)
        self.assertIn("UNAVAILABLE", refused.stderr)
        self.assertNotEqual(run("--tls_server_name=other.ml.svc", "health").returncode, 0)
        ok = run("--tls_server_name=flce.ml.svc", "health")
        self.assertEqual(ok.returncode, 0, ok.stderr)
        self.assertIn("SERVING", ok.stdout)
        self.assertIn("PASS", run("--tls_server_name=pod-3.flce.ml.svc", "smoke").stdout)

    def test_5_sigterm_drains_and_exits_zero(self):
        self.server.process.send_signal(signal.SIGTERM)
        self.assertEqual(self.server.process.wait(timeout=60), 0)
        log = self.server.read_log()
        self.assertIn("shutdown: done", log)
        self.assertIn("rpc=Forward", log)


if __name__ == "__main__":
    sys.exit(run_tests(CliEndToEndTest, "cli_e2e"))
