"""Starts a real flce_server on a free loopback port for Python tests."""

import os
import re
import subprocess
import tempfile
import time


def wait_for(predicate, what, timeout=30.0):
    """Polls `predicate` until it holds; AssertionError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("timed out waiting for " + what)


def tls_flags(certs, name):
    """The server flags for tests/testdata/tls/<name>.crt and <name>.key."""
    return ("--tls_cert_file=" + os.path.join(certs, name + ".crt"),
            "--tls_key_file=" + os.path.join(certs, name + ".key"))


class ServerProcess:
    """flce_server on 127.0.0.1 with the given flags; ``address`` once up.
    Plaintext (--insecure) unless ``tls`` (the flags then name the
    certificates)."""

    def __init__(self, binary, *flags, tls=False, host="127.0.0.1", prefix=(), address=None):
        """``host``: the address to listen on (port chosen by the kernel);
        ``address``: instead, a whole listen address (e.g. "unix:/path");
        ``prefix``: a command the server runs under (e.g. ``ip netns exec
        NAME``)."""
        self.log_path = os.path.join(tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR")),
                                     "server.log")
        # Append mode: the server's writes go to the end whatever the
        # offset, which the server shares with this handle (without it, a
        # line written between a reader's seek and read lands at offset 0,
        # over the log's first lines). Readers open the file afresh.
        self.log = open(self.log_path, "a")
        self.process = subprocess.Popen(
            [*prefix, binary, f"--listen_address={address or host + ':0'}", *(() if tls else ("--insecure",)),
             *flags], stderr=self.log)
        port = None
        for _ in range(400):
            found = re.search(r"listening on port (\d+)", self.read_log())
            if found:
                port = found.group(1)
                break
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        if port is None:
            self.kill()
            raise RuntimeError("flce_server did not start:\n" + self.read_log())
        self.address = address or f"{host}:{port}"

    def read_log(self):
        with open(self.log_path) as f:
            return f.read()

    def kill(self):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def write_junit(result, path, suite_name):
    """Writes a unittest result as JUnit XML (for tools/test.sh's counts)."""
    import xml.etree.ElementTree as ET

    suite = ET.Element("testsuite", name=suite_name, tests=str(result.testsRun),
                       failures=str(len(result.failures)), errors=str(len(result.errors)))
    bad = {t.id(): msg for t, msg in result.failures + result.errors}
    skipped = {t.id(): msg for t, msg in result.skipped}
    for test_id in getattr(result, "ran", []):
        case = ET.SubElement(suite, "testcase", name=test_id.split(".")[-1],
                             classname=test_id.split(".")[-2])
        if test_id in bad:
            ET.SubElement(case, "failure", message="failed").text = bad[test_id]
        elif test_id in skipped:
            case.set("result", "skipped")
    root = ET.Element("testsuites")
    root.append(suite)
    ET.ElementTree(root).write(path)


def run_tests(test_case_class, suite_name):
    """Runs a unittest.TestCase class (or a list of them) verbosely, writes
    $XML_OUTPUT_FILE, and returns the exit status."""
    import unittest

    class RecordingResult(unittest.TextTestResult):
        def startTest(self, test):
            super().startTest(test)
            self.ran = getattr(self, "ran", []) + [test.id()]

    classes = test_case_class if isinstance(test_case_class, (list, tuple)) else [test_case_class]
    suite = unittest.TestSuite(unittest.defaultTestLoader.loadTestsFromTestCase(c)
                               for c in classes)
    result = unittest.TextTestRunner(verbosity=2, resultclass=RecordingResult).run(suite)
    if os.environ.get("XML_OUTPUT_FILE"):
        write_junit(result, os.environ["XML_OUTPUT_FILE"], suite_name)
    return 0 if result.wasSuccessful() else 1
