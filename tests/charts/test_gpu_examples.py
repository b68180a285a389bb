"""The GPU examples hold what their comments say: the trainer fits its GPUs (the same arithmetic, computed
from Qwen3-VL-8B's published shape), the one-node example fits one 8-GPU node, the multi-node one spans two
trainer nodes with four engines, and each states the node label and storage class it needs. (Every example
is also validated against the CRD and the operator's models by test_examples.py, and stored by the real API
server in tests/operator/test_real_validation.py.)"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_helpers import REPO

EXAMPLES = REPO / "manifests" / "examples"
ONE_NODE = EXAMPLES / "qwen3-vl-gpu.yaml"
MULTI_NODE = EXAMPLES / "qwen3-vl-gpu-multinode.yaml"
GB = 1e9
H100_BYTES = 80 * GB

# Qwen3-VL-8B-Instruct's config.json (text model; the vision tower's 0.57e9 parameters added whole).
HIDDEN, LAYERS, FFN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 4096, 36, 12288, 32, 8, 128, 151936
VISION_PARAMS = 0.57e9
LAYER_PARAMS = HIDDEN * HEAD_DIM * (2 * HEADS + 2 * KV_HEADS) + 3 * HIDDEN * FFN
ROOT_PARAMS = 2 * VOCAB * HIDDEN  # embeddings and the (untied) LM head: the root FSDP unit
PARAMS = ROOT_PARAMS + LAYERS * LAYER_PARAMS + VISION_PARAMS
STATE_BYTES_PER_PARAM = 16  # fp32 weights 4, gradients 4, AdamW moments 8 (rawmm.rl.trainer.precision)


def run(path: Path) -> dict[str, Any]:
    (doc,) = [d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == "RLRun"]
    return doc["spec"]


def trainer_gpu_bytes(spec: dict[str, Any]) -> float:
    """The comment's budget: sharded state, gathered bf16 units, the root's gradient, activations, logits."""
    trainer = spec["trainer"]
    ranks = trainer["nodes"] * trainer["gpusPerNode"]
    sharded = ranks if trainer.get("parallelism") == "fsdp" else 1
    tokens = trainer["microBatchTokens"]
    state = STATE_BYTES_PER_PARAM * PARAMS / sharded
    gathered = 2 * ROOT_PARAMS + 2 * 2 * LAYER_PARAMS
    root_gradient = (2 + 4) * ROOT_PARAMS
    assert trainer.get("activationCheckpointing"), "without it each layer keeps ~1.7 GB at 8192 tokens"
    activations = LAYERS * tokens * HIDDEN * 2 + 2 * GB + 2 * GB
    logits = tokens * VOCAB * (2 + 4 + 4 + 4)  # bf16, fp32 copy, log-softmax, its gradient
    return state + gathered + root_gradient + activations + logits + 5 * GB


def stated_total(path: Path) -> float:
    (total,) = re.findall(r"at most ~(\d+) GB", path.read_text())
    return float(total) * GB


def test_the_stated_parameter_count_is_qwen3_vl_8bs() -> None:
    assert f"P = {PARAMS / 1e9:.2f}e9" in ONE_NODE.read_text()
    assert f"P = {PARAMS / 1e9:.2f}e9" in MULTI_NODE.read_text()


def test_ddp_would_not_fit_any_gpu_so_the_examples_shard() -> None:
    for path in (ONE_NODE, MULTI_NODE):
        spec = run(path)
        assert spec["trainer"]["parallelism"] == "fsdp", path.name
        unsharded = {**spec, "trainer": {**spec["trainer"], "parallelism": "ddp"}}
        assert trainer_gpu_bytes(unsharded) > 141 * GB  # more than an H200 holds


@pytest.mark.parametrize("path", [ONE_NODE, MULTI_NODE], ids=lambda p: p.name)
def test_the_trainer_fits_an_h100_as_the_comment_computes(path: Path) -> None:
    need = trainer_gpu_bytes(run(path))
    assert need < 0.85 * H100_BYTES, need / GB
    assert abs(stated_total(path) - need) < 2 * GB, (stated_total(path) / GB, need / GB)


def test_the_one_node_example_fits_one_8_gpu_node() -> None:
    spec = run(ONE_NODE)
    inference, trainer = spec["inference"], spec["trainer"]
    assert trainer["nodes"] == 1
    assert inference["replicas"] * inference["gpus"] + trainer["gpusPerNode"] == 8


def test_the_multi_node_example_spans_two_trainer_nodes_and_four_engines() -> None:
    spec = run(MULTI_NODE)
    assert (spec["trainer"]["nodes"], spec["trainer"]["gpusPerNode"]) == (2, 8)
    assert spec["inference"]["replicas"] == 4
    assert spec["offload"]["accessMode"] == "ReadWriteMany"  # pods on three nodes


@pytest.mark.parametrize("path", [ONE_NODE, MULTI_NODE], ids=lambda p: p.name)
def test_the_labels_and_class_they_need_are_stated(path: Path) -> None:
    spec, text = run(path), path.read_text()
    for role in ("inference", "trainer"):
        assert spec[role]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert "GPU Feature Discovery" in text
    assert spec["offload"]["storageClassName"] in text.split("apiVersion:")[0] or "your ReadWriteMany" in text
