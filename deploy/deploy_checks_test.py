"""Checks on the deployment files that need no Docker engine and no cluster:

- every YAML file passes yamllint (Debian's), and the kustomize base and
  overlays hold together (resources and patches exist, the Service is
  headless, probes are native gRPC on the health port, the grace period
  outlasts drain + shutdown, a GPU is requested, Prometheus annotations name
  the metrics port);
- every flag the manifests, the flag file and the Dockerfile pass exists in
  `flce_server --helpfull`;
- the Dockerfile's build steps are the README's release build;
- shellcheck passes on every shell script.

Run by Bazel (deploy/BUILD) with the path of flce_server as the argument.
"""

import glob
import os
import re
import subprocess
import sys
import unittest

import yaml

from server_process import run_tests

SERVER = sys.argv[1]
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
        self.assertEqual(steps, ["tools/setup.sh",
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

    def test_shellcheck(self):
        scripts = (glob.glob(os.path.join(ROOT, "tools", "*.sh")) +
                   glob.glob(os.path.join(ROOT, "fuzz", "*.sh")) +
                   glob.glob(os.path.join(ROOT, "tests", "*.sh")) +
                   glob.glob(os.path.join(ROOT, "deploy", "docker", "*.sh")) +
                   [os.path.join(ROOT, ".ci", "run")])
        self.assertGreaterEqual(len(scripts), 9)
        result = subprocess.run(["shellcheck", *scripts], capture_output=True, text=True)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)


if __name__ == "__main__":
    sys.exit(run_tests(DeployChecksTest, "deploy_checks"))
