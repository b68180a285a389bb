"""The real node (tests/kube/node.py), started on first use in the session's cluster."""

from __future__ import annotations

import pytest

from kube.cluster import KubeCluster


@pytest.fixture(scope="session")
def real_node(kube_cluster: KubeCluster) -> KubeCluster:
    """The session's cluster with its real node Ready (kubelet, containerd, kube-proxy, CoreDNS)."""
    kube_cluster.start_node()
    return kube_cluster
