"""Fixtures shared by every test area: tiny checkpoints (built once per session), an offload store and the
real Kubernetes control plane (tests/kube/cluster.py; started on first use, one per session)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from rawmm.contract import OffloadStore

if TYPE_CHECKING:
    from kube.cluster import KubeCluster

pytest_plugins = ["terminate"]


@pytest.fixture(scope="session")
def tiny_qwen2_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Qwen2-VL checkpoint directory (seed 0, default tiny max_pixels)."""
    from rawmm.run.tiny import build_tiny_model

    return build_tiny_model("qwen2_vl", tmp_path_factory.mktemp("tiny") / "qwen2_vl", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Qwen3-VL checkpoint directory (seed 0, default tiny max_pixels)."""
    from rawmm.run.tiny import build_tiny_model

    return build_tiny_model("qwen3_vl", tmp_path_factory.mktemp("tiny") / "qwen3_vl", seed=0)


@pytest.fixture
def offload_store(tmp_path: Path) -> OffloadStore:
    """An empty offload store rooted in this test's tmp dir."""
    return OffloadStore(tmp_path / "offload")


@pytest.fixture(scope="session")
def kube_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeCluster]:
    """etcd, kube-apiserver, controller-manager, scheduler and kwok's fake nodes, for the whole session."""
    from kube.cluster import start_cluster

    with start_cluster(tmp_path_factory.mktemp("kube") / "cluster") as cluster:
        yield cluster


# Fixtures that start the real control plane or a Prometheus server: a test using one is a `cluster` test,
# so `-m 'not cluster'` really leaves out everything that needs them.
CLUSTER_FIXTURES = frozenset({"kube_cluster", "prometheus"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked = [
        item.nodeid
        for item in items
        if CLUSTER_FIXTURES & set(getattr(item, "fixturenames", ()))
        and item.get_closest_marker("cluster") is None
    ]
    if unmarked:
        raise pytest.UsageError(f"tests using {sorted(CLUSTER_FIXTURES)} must be marked cluster: {unmarked}")
    # The real-pod runs go last: the GBs of images they run import in the background from the node's start
    # (tests/kube/conftest.py's `real_node`), meanwhile the rest of the session runs.
    items.sort(key=lambda item: item.get_closest_marker("run_images") is not None)
