"""The real node (tests/kube/node.py): real containers, pod network, cluster DNS and Services, and a
teardown that leaves nothing behind."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kube import node
from kube.cluster import KubeCluster, wait_for
from kube.images import BUSYBOX_IMAGE

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def pod(name: str, command: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name.split("-")[0]}},
        "spec": node.for_real_node(
            {
                "containers": [
                    {
                        "name": "main",
                        "image": BUSYBOX_IMAGE,
                        "command": ["sh", "-c", command],
                        **spec.pop("main", {}),
                    }
                ],
                "terminationGracePeriodSeconds": 1,
                **spec,
            }
        ),
    }


def get(cluster: KubeCluster, *args: str) -> dict[str, Any]:
    return json.loads(cluster.kubectl("get", "-o", "json", *args).stdout)


def phase(cluster: KubeCluster, namespace: str, name: str) -> str:
    return get(cluster, "pod", name, "-n", namespace).get("status", {}).get("phase", "")


def ready(cluster: KubeCluster, namespace: str, name: str) -> bool:
    conditions = get(cluster, "pod", name, "-n", namespace).get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def test_pods_reach_each_other_by_name_through_a_headless_service(real_node: KubeCluster) -> None:
    ns = real_node.namespace("node-dns")
    web = pod(
        "web-0",
        'mkdir -p /tmp/www && echo "hello from $(hostname)" > /tmp/www/index.html && exec httpd -f -p 8080 -h /tmp/www',
        hostname="web-0",
        subdomain="web",
        main={"readinessProbe": {"httpGet": {"path": "/", "port": 8080}, "periodSeconds": 1}},
    )
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web"},
        "spec": {"clusterIP": "None", "selector": {"app": "web"}, "ports": [{"name": "http", "port": 8080}]},
    }
    real_node.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump_all([web, service]))
    wait_for(lambda: ready(real_node, ns, "web-0"), "web-0 Ready", timeout=120)
    # The per-pod name the operator writes for engine replicas (<hostname>.<headless Service>), the
    # Service's own name, and the API server through the `kubernetes` ClusterIP Service (kube-proxy).
    client = pod(
        "client",
        f"nslookup web.{ns}.svc.cluster.local && wget -qO- http://web-0.web:8080/"
        f" && wget -qO- http://web-0.web.{ns}.svc.cluster.local:8080/"
        " && nc -w 5 kubernetes.default.svc 443 </dev/null && echo api-reached",
        restartPolicy="Never",
    )
    real_node.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(client))
    wait_for(lambda: phase(real_node, ns, "client") in ("Succeeded", "Failed"), "client done", timeout=120)
    logs = real_node.kubectl("logs", "client", "-n", ns).stdout  # through the kubelet's API
    assert phase(real_node, ns, "client") == "Succeeded", logs
    assert logs.count("hello from web-0") == 2, logs
    assert "api-reached" in logs
    pods = {p["metadata"]["name"]: p for p in get(real_node, "pods", "-n", ns)["items"]}
    web_ip = pods["web-0"]["status"]["podIP"]
    assert f"Address: {web_ip}" in logs  # the headless Service resolves to the pod itself
    for item in pods.values():
        assert item["spec"]["nodeName"] == node.NODE_NAME
        assert ipaddress.ip_address(item["status"]["podIP"]) in ipaddress.ip_network(node.POD_CIDR)
    real_node.kubectl("delete", "namespace", ns, "--wait=false")


def host_iptables() -> str:
    result = subprocess.run(
        [str(node.IPTABLES_BIN / "iptables-save")],
        capture_output=True,
        text=True,
        env={**os.environ, **node.node_env()},
    )
    lines = [line for line in result.stdout.splitlines() if not line.startswith("#")]
    return "\n".join(line.split("[")[0] for line in lines)  # without the packet counters


def leftovers(root: Path, host_if: str, cgroup: str) -> list[str]:
    """What of a stopped cluster in `root` is still there."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if str(root) in (proc / "cmdline").read_bytes().decode(errors="replace"):
                found.append(f"process {proc.name}")
            if str(root) in (proc / "mountinfo").read_text():
                found.append(f"mounts of process {proc.name}")
        except OSError:
            continue
    if Path(f"/sys/class/net/{host_if}").exists():
        found.append(f"link {host_if}")
    found += [f"cgroup {path}" for path in node.cgroup_dirs(cgroup)]
    if root.exists():
        found.append(f"directory {root}")
    return found


def test_sigterm_of_make_cluster_leaves_nothing_behind(tmp_path: Path) -> None:
    """`make cluster` (python -m kube.cluster) with its node and a running container, then SIGTERM: no
    process, container, mount, interface, cgroup, iptables rule or temp dir is left."""
    iptables_before = host_iptables()
    # the operator's image only: the run images take minutes to import, and nothing here runs them
    env = {**os.environ, "TMPDIR": str(tmp_path), "RAWMM_CLUSTER_IMAGES": "operator"}
    process = subprocess.Popen(
        [sys.executable, "-m", "kube.cluster"],
        cwd=Path(__file__).parents[1],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert process.stdout is not None
        lines = []
        for line in process.stdout:
            lines.append(line)
            if line.startswith("export KUBECONFIG="):
                break
        else:
            pytest.fail("make cluster ended before printing its KUBECONFIG:\n" + "".join(lines))
        kubeconfig = line.strip().removeprefix("export KUBECONFIG=")
        (node_line,) = [line for line in lines if line.startswith(f"# node {node.NODE_NAME}")]
        host_if, cgroup = node_line.split("link ")[1].split(", cgroup ")
        cgroup = cgroup.strip()
        (root,) = tmp_path.glob("rawmm-cluster-*")
        kubectl = [str(Path(sys.executable).parent / "kubectl"), f"--kubeconfig={kubeconfig}"]
        subprocess.run(
            [*kubectl, "apply", "-f", "-"],
            input=yaml.safe_dump(pod("sleeper", "exec sleep 3600")),
            check=True,
            capture_output=True,
            text=True,
        )

        def running() -> bool:
            out = subprocess.run(
                [*kubectl, "get", "pod", "sleeper", "-o=jsonpath={.status.phase}"],
                capture_output=True,
                text=True,
            ).stdout
            return out == "Running"

        wait_for(running, "a container running on the node", timeout=120, interval=0.5)
        assert node.cgroup_dirs(cgroup) and Path(f"/sys/class/net/{host_if}").exists()
        assert leftovers(root, host_if, cgroup)  # the check sees a running cluster

        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    wait_for(
        lambda: not leftovers(root, host_if, cgroup), f"nothing left: {leftovers(root, host_if, cgroup)}", 30
    )
    assert host_iptables() == iptables_before
