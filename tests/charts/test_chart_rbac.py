"""The chart's RBAC as rendered: no wildcard and no Secret read, and PodMonitor rights follow their switch.
What the operator does with these grants is proved on kube-apiserver, the operator running as the chart's
ServiceAccount: the default cluster-wide install (no 403, every grant used) in
tests/operator/test_real_lifecycle.py, a namespaced one in tests/operator/test_real_namespaced.py."""

from __future__ import annotations

from typing import Any

from chart_generate import load_generate

generate = load_generate()


def _grants(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {
        (verb, group, resource)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def granted(values: dict[str, Any] | None) -> set[tuple[str, str, str]]:
    return set().union(
        *(_grants(doc.body) for doc in generate.render_chart(values) if doc.kind == "ClusterRole")
    )


def test_no_grant_is_broader_than_named_verbs_on_named_resources() -> None:
    for values in (None, {"operator": {"watchNamespaces": ["a", "b"]}}):
        for verb, group, resource in granted(values):
            assert "*" not in (verb, group, resource)
            assert verb in {"get", "list", "watch", "create", "patch", "update", "delete"}
            assert resource not in {"pods/exec", "serviceaccounts/token"}
            # The run's weights token is created and deleted, never read: no Secret of the cluster is exposed.
            if resource == "secrets":
                assert verb in {"create", "delete"}


def test_pod_monitor_rights_follow_the_pod_monitor_switch() -> None:
    assert ("create", "monitoring.coreos.com", "podmonitors") in granted(None)
    assert not any(
        g[1] == "monitoring.coreos.com" for g in granted({"runs": {"podMonitor": {"enabled": False}}})
    )
