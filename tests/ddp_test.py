"""Data-parallel workers against a real flce_server (CPU): the DDP example
(client/python/examples/ddp_train.py), both recipes, 2 and 3 gloo ranks,
equal to the same training in one process with PyTorch's own loss.

Run by Bazel (tests/BUILD) with the path of flce_server as the argument.
"""

import contextlib
import io
import sys
import unittest

import ddp_train
from server_process import ServerProcess, run_tests

SERVER = sys.argv[1]


class DdpTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = ServerProcess(SERVER, "--backend=cpu")

    @classmethod
    def tearDownClass(cls):
        cls.server.kill()

    def test_ddp_ranks_train_like_one_process(self):
        for recipe in ("autograd", "registered"):
            for world in (2, 3):
                with self.subTest(recipe=recipe, world=world):
                    printed = io.StringIO()
                    with contextlib.redirect_stdout(printed):
                        drift = ddp_train.main(["--server", self.server.address, "--world",
                                                str(world), "--recipe", recipe])
                    self.assertLess(drift, 1e-5, printed.getvalue())
                    self.assertTrue(printed.getvalue().rstrip().endswith("OK"))
        # The registered recipe put each rank's weight once per step.
        self.assertGreaterEqual(self.server.read_log().count("rpc=PutWeight "), 2 * 3)


if __name__ == "__main__":
    sys.exit(run_tests(DdpTest, "DdpTest"))
