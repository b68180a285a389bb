"""The real node (tests/kube/node.py), started on first use in the session's cluster."""

from __future__ import annotations

import pytest

from kube.cluster import KubeCluster


@pytest.fixture(scope="session")
def real_node(kube_cluster: KubeCluster, request: pytest.FixtureRequest) -> KubeCluster:
    """The session's cluster with its real node Ready (kubelet, containerd, kube-proxy, CoreDNS), importing
    the images the session's `run_images` tests name in the background."""
    kube_cluster.start_node()
    wanted = {
        name
        for item in request.session.items
        for mark in item.iter_markers("run_images")
        for name in mark.args
    }
    if wanted:
        kube_cluster.import_images_in_background(*sorted(wanted))
    return kube_cluster
