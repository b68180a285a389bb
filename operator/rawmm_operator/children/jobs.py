"""The run's Jobs: the orchestrator, the trainer (an indexed Job, with a headless Service for torchrun's
rendezvous when it spans nodes) and, with `offload.retention`, the offload volume's garbage collection.

With `trainer.weightTransfer: broadcast` the trainer's rank 0 sends each step's weights into the engines
(docs/architecture.md §6.1, `rawmm.rl.trainer.weight_publish`): its pods get the run's weights token, and
the rendezvous the engines join, at a fixed port (`weights`, `WEIGHT_TRANSFER_PORT`) on the pod's own IP
(the downward API's `status.podIP`). The IP, not index 0's DNS name under the trainer's headless Service:
the address reaches the engines inside each group's init request (rebuilt, with the new pod's IP, after a
trainer pod is replaced), so it need not outlive the pod; rank 0's gloo device binds to that address, which
an IP always names in its own pod, while the DNS name exists only with the Service (several nodes) and a
published record; and it spares rank 0 resolving the first engine's name at start, the default, which fails
while that engine's pod has no IP yet.

The GC is a Job rather than a CronJob: `rawmm gc --config … --watch` runs a pass at start and after every
checkpoint (between steps, as `rawmm run` does), ends after the run's last step, and serves the volume's
usage on its `metrics` port while it runs, where the run's PodMonitor and the operator's status scrape read
it; a CronJob's short-lived pods could be scraped by neither. It mounts the shared volume and the run config
like the trainer, in the trainer image (GC reads rollout batches). A failed GC Job never fails the run: the
run's phase follows the orchestrator and the trainer only.
"""

from __future__ import annotations

from typing import Any

from rawmm.config import RunConfig
from rawmm_operator import pods
from rawmm_operator.children.config import weights_token_env
from rawmm_operator.names import child_name
from rawmm_operator.objects import Manifest, RunRef
from rawmm_operator.spec import (
    RUN_CONFIG_DIR,
    RUN_CONFIG_FILE,
    TORCHRUN_PORT,
    WEIGHT_TRANSFER_PORT,
    RLRunSpec,
    default_image,
)

ORCHESTRATOR_COMPONENT = "orchestrator"
TRAINER_COMPONENT = "trainer"
GC_COMPONENT = "offload-gc"
CONFIG_PATH = str(RUN_CONFIG_DIR / RUN_CONFIG_FILE)
# What `rawmm.rl.trainer.weight_publish` reads (ADDRESS_ENV, PORT_ENV); named here so the operator needs no torch.
WEIGHT_TRANSFER_ADDRESS_ENV = "RAWMM_WEIGHT_TRANSFER_ADDRESS"
WEIGHT_TRANSFER_PORT_ENV = "RAWMM_WEIGHT_TRANSFER_PORT"
WEIGHT_TRANSFER_PORT_NAME = "weights"


def build_orchestrator_job(run: RunRef, spec: RLRunSpec, config: RunConfig) -> Manifest:
    orchestrator = spec.orchestrator
    container = pods.container(
        orchestrator,
        name="orchestrator",
        image=orchestrator.image or default_image("trainer"),
        command=["rawmm"],
        args=["orchestrate", CONFIG_PATH],
        env=pods.env([weights_token_env(run), *pods.COMMON_ENV], orchestrator),
        ports=[
            {"name": "metrics", "containerPort": spec.monitoring.orchestrator_metrics_port, "protocol": "TCP"}
        ],
        resources=pods.container_resources(orchestrator.resources, gpus=0),
        volumeMounts=pods.mounts(orchestrator, config=True),
    )
    return pods.job(
        run,
        spec,
        config,
        name=child_name(run.name, "orchestrator"),
        component=ORCHESTRATOR_COMPONENT,
        role=orchestrator,
        pod=pods.pod_spec(run, spec, orchestrator, [container], config=True),
    )


def trainer_command(run: RunRef, spec: RLRunSpec) -> list[str]:
    """`rawmm train`, under torchrun when the trainer spans several processes."""
    trainer = spec.trainer
    train = ["rawmm", "train", CONFIG_PATH]
    if not trainer.distributed:
        return train
    launcher = ["torchrun", f"--nproc-per-node={max(trainer.gpus_per_node, 1)}"]
    if trainer.nodes == 1:
        launcher.append("--standalone")
    else:
        # Static rendezvous on index 0 of the indexed Job, addressed through the trainer's headless Service.
        job = child_name(run.name, "trainer")
        master = f"{job}-0.{job}.{run.namespace}.svc"
        launcher += [
            f"--nnodes={trainer.nodes}",
            "--node-rank=$(NODE_RANK)",
            f"--master-addr={master}",
            f"--master-port={TORCHRUN_PORT}",
        ]
    return [*launcher, "--no-python", *train]


def weight_transfer_env(run: RunRef) -> list[dict[str, Any]]:
    """A broadcasting trainer's variables: the weights token (rank 0 calls the engines' weight-transfer
    routes) and the rendezvous the engines join (each pod's own IP; rank 0's pod is the one that listens)."""
    return [
        weights_token_env(run),
        {"name": WEIGHT_TRANSFER_ADDRESS_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": WEIGHT_TRANSFER_PORT_ENV, "value": str(WEIGHT_TRANSFER_PORT)},
    ]


def build_trainer_job(run: RunRef, spec: RLRunSpec, config: RunConfig) -> Manifest:
    trainer = spec.trainer
    command = trainer_command(run, spec)
    env: list[dict[str, Any]] = list(pods.COMMON_ENV)
    ports = [{"name": "metrics", "containerPort": spec.monitoring.trainer_metrics_port, "protocol": "TCP"}]
    if trainer.nodes > 1:
        env.append(
            {
                "name": "NODE_RANK",
                "valueFrom": {
                    "fieldRef": {
                        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"
                    }
                },
            }
        )
        ports.append({"name": "rendezvous", "containerPort": TORCHRUN_PORT, "protocol": "TCP"})
    if trainer.weight_transfer == "broadcast":
        env += weight_transfer_env(run)
        ports.append(
            {"name": WEIGHT_TRANSFER_PORT_NAME, "containerPort": WEIGHT_TRANSFER_PORT, "protocol": "TCP"}
        )
    container = pods.container(
        trainer,
        name="trainer",
        image=trainer.image or default_image("trainer"),
        command=command[:1],
        args=command[1:],
        env=pods.env(env, trainer),
        ports=ports,
        resources=pods.container_resources(
            trainer.resources, gpus=trainer.gpus_per_node, accelerator=trainer.accelerator_resource
        ),
        volumeMounts=pods.mounts(trainer, config=True),
    )
    extra = {"subdomain": child_name(run.name, "trainer")} if trainer.nodes > 1 else {}
    return pods.job(
        run,
        spec,
        config,
        name=child_name(run.name, "trainer"),
        component=TRAINER_COMPONENT,
        role=trainer,
        pod=pods.pod_spec(run, spec, trainer, [container], config=True, **extra),
        completionMode="Indexed",
        completions=trainer.nodes,
        parallelism=trainer.nodes,
    )


def build_trainer_service(run: RunRef) -> Manifest:
    """The trainer's headless Service: the DNS name of index 0, torchrun's rendezvous. (The weight
    broadcast's `weights` port needs none: the engines get rank 0's pod IP in each init request.)"""
    name = child_name(run.name, "trainer")
    return pods.service(run, name, TRAINER_COMPONENT, TORCHRUN_PORT, "rendezvous", headless=True)


def build_gc_job(run: RunRef, spec: RLRunSpec, config: RunConfig) -> Manifest:
    retention = spec.offload.retention
    container = pods.container(
        retention,
        name="gc",
        image=retention.image or default_image("trainer"),
        command=["rawmm"],
        args=["gc", "--config", CONFIG_PATH, "--watch"],
        env=pods.env(list(pods.COMMON_ENV), retention),
        ports=[{"name": "metrics", "containerPort": retention.metrics_port, "protocol": "TCP"}],
        resources=pods.container_resources(retention.resources, gpus=0),
        volumeMounts=pods.mounts(retention, config=True),
    )
    return pods.job(
        run,
        spec,
        config,
        name=child_name(run.name, "offload_gc"),
        component=GC_COMPONENT,
        role=retention,
        pod=pods.pod_spec(run, spec, retention, [container], config=True),
    )
