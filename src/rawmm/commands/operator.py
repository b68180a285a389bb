"""`rawmm operator`: run the RLRun operator (kopf) against the current cluster."""

from __future__ import annotations

import argparse
import json
import os

from rawmm.commands import CliError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        metavar="NS",
        help="watch only this namespace (repeatable)",
    )
    scope.add_argument(
        "--all-namespaces", "-A", action="store_true", help="watch every namespace (the default)"
    )
    parser.add_argument(
        "--liveness-port", type=int, default=8080, help="serves /healthz (default: %(default)s)"
    )
    parser.add_argument(
        "--metrics-port", type=int, default=9100, help="serves Prometheus /metrics (default: %(default)s)"
    )
    parser.add_argument("--host", default="0.0.0.0", help="address of both endpoints (default: %(default)s)")
    parser.add_argument(
        "--resync-seconds",
        type=float,
        default=30.0,
        help="reconcile every run at least this often (default: %(default)s)",
    )
    parser.add_argument("--verbose", "-v", action="store_true", help="debug logging")
    # Operator-wide PodMonitor settings; the Helm chart passes them as environment variables.
    parser.add_argument(
        "--pod-monitor",
        choices=["true", "false"],
        default=os.environ.get("RAWMM_POD_MONITOR", "true"),
        help="create a PodMonitor per run (needs the Prometheus Operator; env RAWMM_POD_MONITOR)",
    )
    parser.add_argument(
        "--pod-monitor-interval",
        default=os.environ.get("RAWMM_POD_MONITOR_INTERVAL", "15s"),
        help="scrape interval of run pods (env RAWMM_POD_MONITOR_INTERVAL; default: %(default)s)",
    )
    parser.add_argument(
        "--pod-monitor-labels",
        default=os.environ.get("RAWMM_POD_MONITOR_LABELS", "{}"),
        metavar="JSON",
        help="labels added to every PodMonitor, as a JSON object (env RAWMM_POD_MONITOR_LABELS)",
    )


def _labels(text: str) -> tuple[tuple[str, str], ...]:
    try:
        labels = json.loads(text or "{}")
    except ValueError as exc:
        raise CliError(f"--pod-monitor-labels is not JSON: {exc}") from None
    if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
        raise CliError("--pod-monitor-labels must be a JSON object of strings")
    return tuple(sorted(labels.items()))


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from prometheus_client import start_http_server

    from rawmm_operator.children.monitoring import PodMonitorSettings
    from rawmm_operator.handlers import LoopTiming
    from rawmm_operator.main import cluster_api_client, run_operator

    pod_monitor = PodMonitorSettings(
        enabled=args.pod_monitor == "true",
        interval=args.pod_monitor_interval,
        labels=_labels(args.pod_monitor_labels),
    )
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        api_client = cluster_api_client()
    except Exception as exc:  # kubernetes.config raises several types for "no usable configuration"
        raise CliError(f"no Kubernetes configuration (in-cluster or kubeconfig): {exc}") from None
    start_http_server(args.metrics_port, addr=args.host)
    # kopf installs SIGINT/SIGTERM handlers and stops gracefully on them.
    asyncio.run(
        run_operator(
            api_client,
            namespaces=args.namespace,
            liveness_endpoint=f"http://{args.host}:{args.liveness_port}/healthz",
            timing=LoopTiming(resync_seconds=args.resync_seconds),
            pod_monitor=pod_monitor,
        )
    )
    return 0
