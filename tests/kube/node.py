"""A real node for the test control plane (tests/kube/cluster.py): kubelet, containerd + runc, CNI (bridge,
host-local, loopback), kube-proxy (iptables) and CoreDNS, running real containers.

Everything of the node lives in namespaces of its own, held by one process (`NodeNetwork`): a network
namespace (the pod bridge, the pods' veths, kube-proxy's and the bridge plugin's iptables rules, the DNS
address), a mount namespace (the kubelet's and containerd's mounts, a private /run and /var/log) and a pid
namespace (every node process, shim and container). When the holder dies, however it dies, the kernel
kills every process in it and drops the namespaces, and with them every interface, mount and rule; what
remains on the host is the cgroup directories (removed by `NodeNetwork.stop`, or by the next start's sweep
when the holder was killed) and the files under the cluster's temp dir (removed by its owner).

The host reaches the node over one veth pair on a /30 of 100.64.0.0/10 picked per cluster (the API server
binds the host's end; the kubelet, kube-proxy and CoreDNS reach it there, pods through the `kubernetes`
Service). Pods get 10.244.0.0/24 addresses behind the node (masqueraded towards the host); cluster DNS is
CoreDNS on 169.254.20.10, a node-local address as NodeLocal DNSCache uses, serving cluster.local from the
API server (per-pod and headless-Service names included).

The node is tainted `REAL_NODE_TAINT` (NoSchedule) and labelled `REAL_NODE_LABEL`, so the kwok-only tests'
pods keep landing on the fake nodes; a pod for the real node selects the label and tolerates the taint
(`for_real_node`). Its images are made here (`images.py`) and imported into containerd: nothing is pulled.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import random
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / ".tools" / "k8s"
DEBS = REPO / ".tools" / "node" / "root"  # Debian's packages, unpacked (make .tools/node)
IPTABLES_BIN = REPO / ".tools" / "node" / "bin"  # iptables* -> xtables-nft-multi
NODE_BINARIES = (
    K8S / "kubelet",
    K8S / "kube-proxy",
    K8S / "coredns",
    K8S / "pause",
    DEBS / "usr/bin/containerd",
)
NODE_NAME = "rawmm-node"
POD_CIDR = "10.244.0.0/24"
CLUSTER_CIDR = "10.244.0.0/16"
DNS_IP = "169.254.20.10"
CLUSTER_DOMAIN = "cluster.local"
REAL_NODE_TAINT = "rawmm.dev/real-node"
REAL_NODE_LABEL = "rawmm.dev/real-node"
CGROUP_PREFIX = "rawmm-node-"
# in the node's private /run (cAdvisor looks for containerd there)
CONTAINERD_SOCKET = Path("/run/containerd/containerd.sock")
# in the node's private /run too: its unix sockets' paths stay short, its emptyDirs go with the node
KUBELET_ROOT = Path("/run/kubelet")
CGROUP_ROOT = Path("/sys/fs/cgroup")
LINK_RANGE = ipaddress.ip_network("100.64.0.0/10")


def for_real_node(pod_spec: dict[str, Any]) -> dict[str, Any]:
    """`pod_spec` with the node selector and toleration that place it on the real node."""
    return {
        **pod_spec,
        "nodeSelector": {**pod_spec.get("nodeSelector", {}), REAL_NODE_LABEL: "true"},
        "tolerations": [
            *pod_spec.get("tolerations", []),
            {"key": REAL_NODE_TAINT, "operator": "Exists", "effect": "NoSchedule"},
        ],
    }


def node_env() -> dict[str, str]:
    """PATH and library paths for the node's processes: Debian's unpacked containerd, shim, runc, CNI
    plugins and iptables before the system's."""
    lib = DEBS / "usr/lib/x86_64-linux-gnu"
    return {
        "PATH": os.pathsep.join(
            [
                str(IPTABLES_BIN),
                str(DEBS / "usr/bin"),
                str(DEBS / "usr/sbin"),
                "/usr/sbin",
                "/usr/bin",
                "/sbin",
                "/bin",
            ]
        ),
        "LD_LIBRARY_PATH": str(lib),
        "XTABLES_LIBDIR": str(lib / "xtables"),
        "HOME": "/root",
    }


def missing_node_tools() -> list[str]:
    return [str(path.relative_to(REPO)) for path in NODE_BINARIES if not path.is_file()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_cgroup_tree(top: Path) -> bool:
    """rmdir `top` and its subdirectories, deepest first (cgroup v1 files cannot be unlinked, empty
    cgroups can be rmdir'ed); True when it is gone."""
    if not top.is_dir():
        return True
    for dirpath, _dirnames, _files in sorted(os.walk(top), key=lambda entry: -entry[0].count("/")):
        with contextlib.suppress(OSError):
            os.rmdir(dirpath)
    return not top.exists()


def cgroup_dirs(name: str) -> list[Path]:
    """`name`'s directory in every mounted cgroup v1 hierarchy (or the v2 root) that has it."""
    roots = (
        [p for p in CGROUP_ROOT.iterdir() if p.is_dir() and not p.is_symlink()]
        if CGROUP_ROOT.is_dir()
        else []
    )
    return [root / name for root in [CGROUP_ROOT, *roots] if (root / name).is_dir()]


def sweep_stale_cgroups() -> None:
    """Remove the cgroups of nodes whose holder is dead (a run that was SIGKILLed before its cleanup)."""
    if not CGROUP_ROOT.is_dir():
        return
    for hierarchy in [CGROUP_ROOT, *CGROUP_ROOT.iterdir()]:
        with contextlib.suppress(OSError):
            for entry in hierarchy.iterdir():
                suffix = entry.name.removeprefix(CGROUP_PREFIX)
                if entry.name.startswith(CGROUP_PREFIX) and suffix.isdigit() and not _pid_alive(int(suffix)):
                    _remove_cgroup_tree(entry)


def _host_addresses() -> set[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    out = subprocess.run(
        ["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=True
    ).stdout
    return {
        ipaddress.ip_interface(line.split()[3]).network for line in out.splitlines() if len(line.split()) > 3
    }


@dataclass
class NodeNetwork:
    """The node's namespaces, held by `holder` (unshare, its child the namespaces' pid 1), and the veth
    pair host_if (host_ip, on the host) <-> eth0 (node_ip, in the node's network namespace)."""

    holder: subprocess.Popen[bytes]
    init_pid: int
    host_if: str
    host_ip: str
    node_ip: str

    @property
    def cgroup(self) -> str:
        """The cgroup (below each hierarchy's root) the kubelet puts every pod under."""
        return f"{CGROUP_PREFIX}{self.holder.pid}"

    def make_cgroups(self) -> None:
        """The kubelet's cgroup root in every hierarchy (it refuses to start without it); cgroup v1's cpuset
        needs its cpus and mems before a task may join."""
        for hierarchy in (p for p in CGROUP_ROOT.iterdir() if p.is_dir() and not p.is_symlink()):
            if hierarchy.name == "unified" or not (hierarchy / "cgroup.procs").exists():
                continue
            (hierarchy / self.cgroup).mkdir(exist_ok=True)
            for name in ("cpuset.cpus", "cpuset.mems"):
                if (hierarchy / name).exists():
                    (hierarchy / self.cgroup / name).write_text((hierarchy / name).read_text())

    def enter(self, *argv: str) -> list[str]:
        """`argv` as a command run inside the node's namespaces (paths must be absolute)."""
        return ["nsenter", f"--target={self.init_pid}", "--net", "--mount", "--pid", "--", *argv]

    def run(self, *argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            self.enter(*argv),
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **node_env()},
        )
        if check and result.returncode != 0:
            raise RuntimeError(
                f"in the node: {' '.join(argv)} failed ({result.returncode}):\n{result.stderr}"
            )
        return result

    @classmethod
    def create(cls, log_path: Path) -> NodeNetwork:
        """Start the holder, mount the node's private /run and /var/log, and link it to the host."""
        sweep_stale_cgroups()
        pause = K8S / "pause"
        setup = (
            "mount -t tmpfs -o mode=0755 rawmm-node-run /run"
            " && mount -t tmpfs -o mode=0755 rawmm-node-log /var/log"
            " && ip link set lo up"
            " && echo 1 > /proc/sys/net/ipv4/ip_forward"
            f" && exec {pause}"
        )
        with log_path.open("wb") as log:
            # setpriv: the holder dies with the process that started it (a SIGKILLed pytest or `make
            # cluster` included); --kill-child: the namespaces' pid 1 dies with the holder.
            holder = subprocess.Popen(
                [
                    "setpriv",
                    "--pdeathsig=KILL",
                    "--",
                    "unshare",
                    "--net",
                    "--mount",
                    "--pid",
                    "--fork",
                    "--kill-child",
                    "--propagation=private",
                    "--mount-proc",
                    "sh",
                    "-c",
                    setup,
                ],  # fmt: skip
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            init_pid = cls._wait_init(holder, log_path)
            host_if, host_ip, node_ip = cls._link(holder.pid, init_pid)
        except BaseException:
            cls._kill(holder)
            raise
        return cls(holder, init_pid, host_if, host_ip, node_ip)

    @staticmethod
    def _wait_init(holder: subprocess.Popen[bytes], log_path: Path) -> int:
        """The pid (on the host) of the namespaces' pid 1 once its setup ran (it is then the pause program)."""
        deadline = time.monotonic() + 30
        pause = str(K8S / "pause")
        while time.monotonic() < deadline:
            if holder.poll() is not None:
                raise RuntimeError(
                    f"the node's namespaces: exited {holder.returncode}: {log_path.read_text()}"
                )
            children = Path(f"/proc/{holder.pid}/task/{holder.pid}/children")
            with contextlib.suppress(OSError):
                for pid in children.read_text().split():
                    if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode() == pause:
                        return int(pid)
            time.sleep(0.05)
        raise RuntimeError("the node's namespaces: not set up after 30 s")

    @staticmethod
    def _link(holder_pid: int, init_pid: int) -> tuple[str, str, str]:
        host_if = f"rawmm{holder_pid:x}"[:15]
        subprocess.run(
            ["ip", "link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns", str(init_pid)],
            check=True,
            capture_output=True,
        )
        used = _host_addresses()
        rng = random.Random()
        for _ in range(100):
            net = ipaddress.ip_network(
                (int(LINK_RANGE.network_address) + 4 * rng.randrange(LINK_RANGE.num_addresses // 4), 30)
            )
            if any(net.overlaps(other) for other in used):
                continue
            host_ip, node_ip = (str(ip) for ip in list(net.hosts())[:2])
            if subprocess.run(
                ["ip", "addr", "add", f"{host_ip}/30", "dev", host_if], capture_output=True
            ).returncode:
                continue  # taken meanwhile
            break
        else:
            raise RuntimeError("no free /30 in 100.64.0.0/10 for the node's link")
        subprocess.run(["ip", "link", "set", host_if, "up"], check=True, capture_output=True)
        inside = ["nsenter", f"--target={init_pid}", "--net", "--"]
        for command in (
            ["ip", "addr", "add", f"{node_ip}/30", "dev", "eth0"],
            ["ip", "link", "set", "eth0", "up"],
            ["ip", "route", "add", "default", "via", host_ip],
            ["ip", "addr", "add", f"{DNS_IP}/32", "dev", "lo"],  # this kernel has no dummy links
        ):
            subprocess.run([*inside, *command], check=True, capture_output=True)
        return host_if, host_ip, node_ip

    @staticmethod
    def _kill(holder: subprocess.Popen[bytes]) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(holder.pid, 9)
        with contextlib.suppress(subprocess.TimeoutExpired):
            holder.wait(15)

    def stop(self) -> None:
        """Kill everything in the namespaces (the kernel then drops their interfaces, rules and mounts),
        wait until the host's end of the link is gone, remove the pods' cgroups."""
        self._kill(self.holder)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (
            _pid_alive(self.init_pid) or Path(f"/sys/class/net/{self.host_if}").exists()
        ):
            time.sleep(0.05)
        for _ in range(50):  # a cgroup is busy for a moment after its last task exits
            if all(_remove_cgroup_tree(path) for path in cgroup_dirs(self.cgroup)):
                break
            time.sleep(0.1)


def wait_http(url: str, what: str, check_alive: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        check_alive()
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).is_success:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout:.0f} s")
        time.sleep(0.2)


def containerd_config(root: Path, sandbox_image: str) -> str:
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "{root / "containerd"}"
state = "/run/containerd"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "{CONTAINERD_SOCKET}"

[plugins."io.containerd.internal.v1.opt"]
  path = "{root / "opt"}"

[{cri}]
  sandbox_image = "{sandbox_image}"
  enable_cdi = false
  # Processes here lack CAP_SYS_RESOURCE: none may lower an oom_score_adj, and runc failed to start every
  # sandbox (-998) and Guaranteed container (-997). Restricted: never below containerd's own (0).
  restrict_oom_score_adj = true

[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"

[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{cri}.containerd.runtimes.runc.options]
  BinaryName = "{DEBS / "usr/sbin/runc"}"
  SystemdCgroup = false

[{cri}.cni]
  bin_dir = "{DEBS / "usr/lib/cni"}"
  conf_dir = "{root / "cni"}"
"""


def cni_config(root: Path) -> str:
    return json.dumps(
        {
            "cniVersion": "1.0.0",
            "name": "rawmm-pods",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": "cni0",
                    "isGateway": True,
                    "ipMasq": True,  # towards the host: it has no route to the pod network
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": POD_CIDR}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": str(root / "ipam"),
                    },
                },
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }
    )


def kubelet_config(root: Path, network: NodeNetwork, ca_file: Path, kubelet_port: int) -> dict[str, Any]:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        # cgroup v1 is in maintenance since Kubernetes 1.31; the kubelet refuses it unless told otherwise.
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": f"/{network.cgroup}",
        "cgroupsPerQOS": True,
        "containerRuntimeEndpoint": f"unix://{CONTAINERD_SOCKET}",
        "address": network.node_ip,
        "port": kubelet_port,
        "readOnlyPort": 0,
        "healthzBindAddress": network.node_ip,
        "healthzPort": kubelet_port + 1,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": False},
            "x509": {"clientCAFile": str(ca_file)},
        },
        "authorization": {"mode": "AlwaysAllow"},
        "clusterDNS": [DNS_IP],
        "clusterDomain": CLUSTER_DOMAIN,
        "resolvConf": str(root / "resolv.conf"),
        "podLogsDir": str(root / "pod-logs"),
        "failSwapOn": False,
        "registerWithTaints": [{"key": REAL_NODE_TAINT, "value": "true", "effect": "NoSchedule"}],
        "maxPods": 30,
        "serializeImagePulls": False,
        # A shared test machine: no evictions and no image GC of the imported images. 0% turns a signal off;
        # the host's page cache, full after an image import, would otherwise read as memory pressure.
        "evictionHard": {
            signal: "0%"
            for signal in ("memory.available", "nodefs.available", "nodefs.inodesFree", "imagefs.available")
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "nodeStatusUpdateFrequency": "5s",
        "shutdownGracePeriod": "0s",
    }


def kube_proxy_config(kubeconfig: Path, network: NodeNetwork) -> dict[str, Any]:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "mode": "iptables",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "hostnameOverride": NODE_NAME,
        "bindAddress": network.node_ip,
        "clusterCIDR": CLUSTER_CIDR,
        "healthzBindAddress": f"{network.node_ip}:10256",
        "metricsBindAddress": "127.0.0.1:10249",
        # Service traffic is SNATed to the node, so a reply between two pods on the bridge comes back
        # through the node's conntrack (no dependency on br_netfilter's per-namespace setting).
        "iptables": {"masqueradeAll": True},
        # the conntrack table size and timeouts are sysctls of the host, not of the node's namespace
        "conntrack": {"maxPerCore": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
    }


def corefile(kubeconfig: Path, ready_port: int, node_ip: str) -> str:
    return f""".:53 {{
    bind {DNS_IP}
    ready {node_ip}:{ready_port}
    errors
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig}
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    cache 5
}}
"""


def cri_ctr(network: NodeNetwork, *args: str, timeout: float = 60) -> None:
    """`ctr` on the node's containerd, in the CRI's namespace (k8s.io), where the kubelet's images and
    containers are."""
    ctr = str(DEBS / "usr/bin/ctr")
    network.run(ctr, f"--address={CONTAINERD_SOCKET}", "--namespace=k8s.io", *args, timeout=timeout)


def import_images(network: NodeNetwork, archives: list[Path]) -> None:
    """`ctr images import` each OCI archive into the CRI's namespace (k8s.io), unpacked for overlayfs."""
    for archive in archives:
        # the run images are GBs (torch and its CUDA runtime): minutes on a busy disk
        cri_ctr(network, "images", "import", str(archive), timeout=1200)


def tag_image(network: NodeNetwork, source: str, target: str) -> None:
    """A second name for an imported image (`ctr images tag`), as a push to another registry would give."""
    cri_ctr(network, "images", "tag", "--force", source, target)


def signal_container(network: NodeNetwork, container_id: str, signal: str) -> None:
    """Send `signal` to a container's main process (`ctr tasks kill`), as the OOM killer or a node agent
    would: from outside the pod, unseen by the API server."""
    cri_ctr(network, "tasks", "kill", "--signal", signal, container_id)


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
