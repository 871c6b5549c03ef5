"""Checks on the deployment files that need no Docker engine and no cluster:

- every YAML file passes yamllint (Debian's), and the kustomize base and
  overlays hold together (resources and patches exist, the Service is
  headless, probes are native gRPC on the health port, the grace period
  outlasts drain + shutdown, a GPU is requested, Prometheus annotations name
  the metrics port);
- every flag the manifests, the flag file and the Dockerfile pass exists in
  `flce_server --helpfull`;
- the Dockerfile's build steps are the README's release build;
- deploy/README.md's certificate and token commands make files a TLS server
  with tokens serves and a worker dialling by IP reaches;
- shellcheck passes on every shell script.

Run by Bazel (deploy/BUILD) with the path of flce_server as the argument.
"""

import glob
import os
import re
import subprocess
import sys
import tempfile
import unittest

import yaml

from server_process import ServerProcess, run_tests

SERVER, CLI = sys.argv[1], sys.argv[2]
ROOT = os.path.join(os.environ.get("TEST_SRCDIR", "."), "flce")
K8S = os.path.join(ROOT, "deploy", "k8s")


def load(path):
    with open(path) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def server_flags():
    out = subprocess.run([SERVER, "--helpfull"], capture_output=True, text=True).stdout
    return set(re.findall(r"^\s+--([a-z_0-9]+) ", out, re.M))


def flags_in(args):
    return [re.match(r"--([a-z_0-9]+)", a).group(1) for a in args if a.startswith("--")]


def flag_value(args, name):
    for a in args:
        if a.startswith("--%s=" % name):
            return a.split("=", 1)[1]
    return None


def byte_count(text):
    """A flce_server byte flag's value (17179869184, 16GiB, ...) or a
    Kubernetes quantity (96Gi), in bytes."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(KiB|MiB|GiB|TiB|Ki|Mi|Gi|Ti|KB|MB|GB|TB|B)?", text)
    scale = {None: 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
    for i, unit in enumerate(["K", "M", "G", "T"]):
        scale[unit + "i"] = scale[unit + "iB"] = 1024 ** (i + 1)
    return int(float(m.group(1)) * scale[m.group(2)])


def seconds(duration):
    m = re.fullmatch(r"(\d+)(s|m)", duration)
    return int(m.group(1)) * (60 if m.group(2) == "m" else 1)


class DeployChecksTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.flags = server_flags()
        cls.base = {}
        for path in glob.glob(os.path.join(K8S, "base", "*.yaml")):
            for doc in load(path):
                cls.base[doc["kind"]] = doc
        cls.container = cls.base["Deployment"]["spec"]["template"]["spec"]["containers"][0]

    def test_yamllint(self):
        files = sorted(glob.glob(os.path.join(K8S, "**", "*.yaml"), recursive=True))
        self.assertGreater(len(files), 5)
        config = "{extends: default, rules: {line-length: {max: 100}, document-start: disable}}"
        result = subprocess.run(["yamllint", "-s", "-d", config, *files],
                                capture_output=True, text=True)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)

    def test_kustomizations_reference_files_that_exist(self):
        for path in glob.glob(os.path.join(K8S, "**", "kustomization.yaml"), recursive=True):
            here = os.path.dirname(path)
            k = load(path)[0]
            self.assertEqual(k["kind"], "Kustomization", path)
            for ref in k.get("resources", []):
                self.assertTrue(os.path.exists(os.path.join(here, ref)), (path, ref))
            for patch in k.get("patches", []):
                self.assertTrue(os.path.exists(os.path.join(here, patch["path"])), (path, patch))
            for gen in k.get("configMapGenerator", []):
                for f in gen["files"]:
                    self.assertTrue(os.path.exists(os.path.join(here, f)), (path, f))

    def test_every_flag_passed_exists_in_the_server(self):
        self.assertIn("listen_address", self.flags)
        self.assertNotIn("no_such_flag", self.flags)  # the check can fail
        passed = flags_in(self.container["args"])
        with open(os.path.join(K8S, "base", "flags")) as f:
            passed += flags_in(line.strip() for line in f)
        for doc in load(os.path.join(K8S, "overlays", "dev", "cpu-plaintext.yaml"))[0]:
            if doc["path"].endswith("/args"):
                passed += flags_in(doc["value"])
        with open(os.path.join(ROOT, "deploy", "docker", "Dockerfile")) as f:
            cmd = re.search(r"^CMD \[(.*)\]$", f.read(), re.M).group(1)
        passed += flags_in(a.strip().strip('"') for a in cmd.split(","))
        self.assertGreater(len(passed), 20)
        unknown = sorted(set(passed) - self.flags)
        self.assertEqual(unknown, [], "flags flce_server does not have")

    def test_memory_budgets_fit_the_pod(self):
        # What a client can make the server hold (sessions, registered
        # weights, requests in flight), with the flag file first and the
        # arguments after it (the later value wins), against the pod's limit.
        with open(os.path.join(K8S, "base", "flags")) as f:
            flag_file = [line.strip() for line in f if line.strip()]
        dev = {d["path"].rsplit("/", 1)[1]: d["value"] for d in
               load(os.path.join(K8S, "overlays", "dev", "cpu-plaintext.yaml"))[0]}
        pods = {"base": (self.container["args"], self.container["resources"]),
                "dev": (dev["args"], dev["resources"])}
        defaults = {"session_memory_bytes": 16 << 30, "weight_memory_bytes": 32 << 30,
                    "request_memory_bytes": 16 << 30}
        for name, (args, resources) in pods.items():
            values = dict(defaults)
            for a in flag_file + list(args):
                flag = re.match(r"--([a-z_]+)=(.*)", a)
                if flag and flag.group(1) in values:
                    values[flag.group(1)] = byte_count(flag.group(2))
            limit = byte_count(resources["limits"]["memory"])
            self.assertLessEqual(sum(values.values()) + (1 << 30), limit, (name, values))

    def test_deployment_probes_grace_gpu_and_scrape_annotations(self):
        spec = self.base["Deployment"]["spec"]["template"]
        args = self.container["args"]
        health_port = int(flag_value(args, "health_address").rsplit(":", 1)[1])
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            self.assertEqual(self.container[probe]["grpc"]["port"], health_port, probe)
        self.assertEqual(self.container["readinessProbe"]["grpc"]["service"],
                         "flce.v1.LossService")
        grace = spec["spec"]["terminationGracePeriodSeconds"]
        self.assertGreater(grace, seconds(flag_value(args, "drain_timeout")) +
                           seconds(flag_value(args, "shutdown_grace")))
        self.assertEqual(self.container["resources"]["requests"]["nvidia.com/gpu"], 1)
        # The bulk port is fixed (not "auto"'s free port), declared and served.
        bulk_port = int(flag_value(args, "bulk_address").rsplit(":", 1)[1])
        ports = {p["name"]: p["containerPort"] for p in self.container["ports"]}
        self.assertEqual(ports["bulk"], bulk_port)
        self.assertIn("bulk", [p["targetPort"] for p in self.base["Service"]["spec"]["ports"]])
        metrics_port = flag_value(args, "metrics_address").rsplit(":", 1)[1]
        self.assertEqual(spec["metadata"]["annotations"]["prometheus.io/port"], metrics_port)
        self.assertEqual(spec["metadata"]["annotations"]["prometheus.io/scrape"], "true")
        self.assertTrue(spec["spec"]["securityContext"]["runAsNonRoot"])
        self.assertEqual(self.base["Service"]["spec"]["clusterIP"], "None")
        self.assertEqual(self.base["PodDisruptionBudget"]["spec"]["maxUnavailable"], 1)

    def test_dockerfile_builds_as_the_readme_says(self):
        with open(os.path.join(ROOT, "README.md")) as f:
            readme = f.read()
        block = re.search(r"The release build.*?```sh\n(.*?)```", readme, re.S).group(1)
        steps = [line.strip() for line in block.splitlines() if line.strip()]
        self.assertEqual(steps, ["tools/setup.sh --build",
                                 "bazel build //server:flce_server //client:flce"])
        with open(os.path.join(ROOT, "deploy", "docker", "Dockerfile")) as f:
            dockerfile = f.read()
        # The first command of each RUN instruction.
        runs = [line[4:].split(" && ")[0].rstrip(" \\")
                for line in dockerfile.splitlines() if line.startswith("RUN ")]
        for step in steps:
            self.assertIn(step, runs, "the Dockerfile must RUN '%s'" % step)
        self.assertRegex(dockerfile, r"(?m)^USER 10001$")
        self.assertRegex(dockerfile, r'(?m)^ENTRYPOINT \["/opt/flce/bin/flce_server"\]$')
        self.assertRegex(dockerfile, r"(?m)^HEALTHCHECK ")

    def test_secrets_stay_out_of_git_and_the_build_context(self):
        def patterns(name):
            with open(os.path.join(ROOT, name)) as f:
                return {l.strip() for l in f if l.strip() and not l.startswith("#")}
        ignored_by_git = patterns(".gitignore")
        for p in ("*.key", "*.pem", "*.crt", "tokens", "secrets/"):
            self.assertIn(p, ignored_by_git)
        context = patterns(".dockerignore")
        for p in (".git", "bazel-*", "**/*.key", "**/*.pem", "**/*.crt", "**/tokens",
                  "**/secrets"):
            self.assertIn(p, context)
        # The bases are build arguments whose defaults are the public images.
        with open(os.path.join(ROOT, "deploy", "docker", "Dockerfile")) as f:
            dockerfile = f.read()
        for arg, default in [("BUILD_BASE", "debian:12"), ("CPU_BASE", "debian:12-slim"),
                             ("GPU_BASE", "nvidia/cuda:13.0.0-runtime-ubuntu24.04")]:
            self.assertRegex(dockerfile, r"(?m)^ARG %s=%s$" % (arg, re.escape(default)))
            self.assertIn("${%s}" % arg, dockerfile)

    def test_readme_certificates_and_tokens_serve_a_worker(self):
        with open(os.path.join(ROOT, "deploy", "README.md")) as f:
            readme = f.read()
        block = re.search(r"## 3\. Certificates and tokens.*?```sh\n(.*?)```", readme, re.S).group(1)
        tmp = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
        here = os.path.join(tmp, "deploy", "k8s", "overlays", "production")
        os.makedirs(here)
        result = subprocess.run(["bash", "-euc", block], cwd=tmp, capture_output=True, text=True)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(sorted(os.listdir(here)),
                         ["ca.crt", "ca.key", "tls.crt", "tls.key", "tokens", "trainer-a.token",
                          "trainer-b.token"])
        with open(os.path.join(here, "tokens")) as f:
            lines = [l.split() for l in f]
        self.assertEqual([l[0] for l in lines], ["trainer-a", "trainer-b"])
        self.assertEqual(len(lines[0][1]), 64)
        server = ServerProcess(SERVER, "--backend=cpu",
                               "--tls_cert_file=" + os.path.join(here, "tls.crt"),
                               "--tls_key_file=" + os.path.join(here, "tls.key"),
                               "--auth_tokens_file=" + os.path.join(here, "tokens"), tls=True)
        self.addCleanup(server.kill)
        # Dialled by IP, as the port-forward or an explicit pod is, checking
        # the Service's name.
        health = subprocess.run(
            [CLI, "--server=" + server.address, "--tls_ca_file=" + os.path.join(here, "ca.crt"),
             "--tls_server_name=flce.ml.svc", "--token_file=" + os.path.join(here, "trainer-a.token"),
             "smoke", "--n=9", "--h=8", "--v=33"], capture_output=True, text=True, timeout=60)
        self.assertEqual(health.returncode, 0, health.stdout + health.stderr)
        self.assertIn("PASS", health.stdout)

    def test_shellcheck(self):
        scripts = (glob.glob(os.path.join(ROOT, "tools", "*.sh")) +
                   glob.glob(os.path.join(ROOT, "fuzz", "*.sh")) +
                   glob.glob(os.path.join(ROOT, "tests", "*.sh")) +
                   glob.glob(os.path.join(ROOT, "deploy", "docker", "*.sh")) +
                   glob.glob(os.path.join(ROOT, "deploy", "*.sh")) +
                   [os.path.join(ROOT, ".ci", "run")])
        self.assertGreaterEqual(len(scripts), 9)
        result = subprocess.run(["shellcheck", *scripts], capture_output=True, text=True)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)


if __name__ == "__main__":
    sys.exit(run_tests(DeployChecksTest, "deploy_checks"))
