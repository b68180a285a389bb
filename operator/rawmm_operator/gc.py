"""The offload volume's garbage collection for a run: RLRun in, the `<run>-offload-gc` Job out (pure).

A Job rather than a CronJob: `rawmm gc --config … --watch` runs a pass at start and after every checkpoint
(between steps, as `rawmm run` does), ends after the run's last step, and serves the volume's usage on its
`metrics` port while it runs, where the run's PodMonitor and the operator's status scrape read it; a CronJob's
short-lived pods could be scraped by neither. It mounts the shared volume and the run config like the
trainer, in the trainer image (GC reads rollout batches). A failed GC Job never fails the run: the run's
phase follows the orchestrator and the trainer only.
"""

from __future__ import annotations

from rawmm_operator import builders
from rawmm_operator.names import child_name
from rawmm_operator.spec import RUN_CONFIG_DIR, RUN_CONFIG_FILE, RLRunSpec, default_image

COMPONENT = "offload-gc"


def build_gc_job(run: builders.RunRef, spec: RLRunSpec) -> builders.Manifest:
    retention = spec.offload.retention
    container = builders._container(
        retention,
        name="gc",
        image=retention.image or default_image("trainer"),
        command=["rawmm"],
        args=["gc", "--config", str(RUN_CONFIG_DIR / RUN_CONFIG_FILE), "--watch"],
        env=builders._env(list(builders.COMMON_ENV), retention),
        ports=[{"name": "metrics", "containerPort": retention.metrics_port, "protocol": "TCP"}],
        resources=builders.container_resources(retention.resources, gpus=0),
        volumeMounts=builders._mounts(retention, config=True),
    )
    pod_spec = builders._pod_spec(run, spec, retention, [container], config=True)
    return builders._job(
        run,
        spec,
        name=child_name(run.name, "offload_gc"),
        component=COMPONENT,
        role=retention,
        pod_spec=pod_spec,
    )
