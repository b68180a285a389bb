from __future__ import annotations

import copy
import itertools
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import celpy
import jsonschema
import kubernetes_validate
import pytest
import yaml
from operator_samples import SPECS, apply_schema_defaults, merged, rlrun
from pydantic import ValidationError

from rawmm.config import TrainerConfig
from rawmm.config.quantity import parse_byte_size
from rawmm_operator.crd import crd_manifest, crd_yaml, spec_schema
from rawmm_operator.spec import InferenceSpec, RLRunSpec, parse_spec, run_name_problem

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "manifests" / "crds" / "rlruns.rawmm.dev.yaml"
KUBERNETES_VERSIONS = ["1.31", kubernetes_validate.latest_version()]


def open_api_schema() -> dict[str, Any]:
    return crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def prune_nulls(value: Any) -> Any:
    """The API server drops nulls of non-nullable fields before validation."""
    if isinstance(value, dict):
        return {k: prune_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [prune_nulls(v) for v in value]
    return value


def as_stored(body: dict[str, Any]) -> dict[str, Any]:
    """An RLRun as the API server stores it: nulls pruned, schema defaults applied."""
    return apply_schema_defaults(open_api_schema(), prune_nulls(copy.deepcopy(body)))


def schema_nodes(node: dict[str, Any], path: str = "") -> Any:
    """Every schema node: the root, its properties, items and map values, recursively."""
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from schema_nodes(sub, f"{path}.{name}")
    if "items" in node:
        yield from schema_nodes(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from schema_nodes(node["additionalProperties"], f"{path}{{}}")


def test_committed_crd_is_the_generated_one() -> None:
    assert CRD_FILE.read_text() == crd_yaml(), "run `rawmm manifests` to regenerate the CRD"


def test_every_spec_property_has_a_description() -> None:
    """`kubectl explain rlrun.spec.<field>` prints these; a property without one says `<no description>`.
    The hyperparameters' come from the run config's fields (one source), the Kubernetes ones from the spec."""
    missing = [
        f"{path}.{name}"
        for path, node in schema_nodes(spec_schema(), "spec")
        for name, sub in node.get("properties", {}).items()
        if not sub.get("description", "").strip()
    ]
    assert missing == [], f"RLRun spec properties without a description: {missing}"
    stored = yaml.safe_load(CRD_FILE.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert stored["properties"]["spec"]["properties"]["trainer"]["properties"]["parallelism"]["description"]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_crd_is_a_valid_custom_resource_definition(version: str) -> None:
    kubernetes_validate.validate(crd_manifest(), version, strict=True)


def test_schema_is_structural() -> None:
    for path, node in schema_nodes(open_api_schema()):
        assert not {"$ref", "$defs", "anyOf", "allOf", "oneOf", "title"} & set(node), path
        assert "type" in node or node.get("x-kubernetes-int-or-string"), f"{path} has no type"
        if "additionalProperties" in node:
            assert isinstance(node["additionalProperties"], dict) and "properties" not in node, path
        for bound in ("exclusiveMinimum", "exclusiveMaximum"):
            assert isinstance(node.get(bound, True), bool), f"{path}: OpenAPI v3.0 wants a boolean {bound}"


# What Python's re has and RE2 (kube-apiserver's `pattern` engine) refuses: lookaround, backreferences,
# possessive and atomic groups.
NOT_RE2 = re.compile(r"\(\?[=!<>]|\(\?<[=!]|\\[1-9]|[*+?}]\+|\(\?>")


def test_every_pattern_is_re2() -> None:
    """kube-apiserver compiles every schema pattern with RE2 and refuses the whole CRD otherwise."""
    patterns = [
        (path, node["pattern"]) for path, node in schema_nodes(open_api_schema()) if "pattern" in node
    ]
    assert len(patterns) >= 5
    for path, pattern in patterns:
        assert not NOT_RE2.search(pattern), f"{path}: {pattern} is not RE2"
        re.compile(pattern)


def test_every_schema_default_is_valid_for_its_own_schema() -> None:
    defaults = [(path, node) for path, node in schema_nodes(spec_schema()) if "default" in node]
    assert len(defaults) > 40
    for _, node in defaults:
        jsonschema.Draft4Validator(node).validate(node["default"])


def test_status_has_no_defaults_and_conditions_are_a_map_by_type() -> None:
    status = open_api_schema()["properties"]["status"]
    assert not [path for path, node in schema_nodes(status) if "default" in node]
    conditions = status["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]


def test_crd_names_printer_columns_and_status_subresource() -> None:
    crd = crd_manifest()
    assert crd["metadata"]["name"] == "rlruns.rawmm.dev"
    names = crd["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"]) == ("RLRun", "rlruns", ["rlr"])
    version = crd["spec"]["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert {"Phase", "Model", "Step", "Cache Hit Rate", "Age"} <= set(columns)
    schema = open_api_schema()
    for json_path in columns.values():
        if json_path.startswith(".metadata"):
            continue
        node = schema
        for part in json_path.strip(".").split("."):
            node = node["properties"][part]  # every column points at a field the schema has


@pytest.mark.parametrize("name", sorted(SPECS))
def test_defaults_applied_by_the_server_equal_the_models_defaults(name: str) -> None:
    body = rlrun("run", SPECS[name])
    assert parse_spec("run", as_stored(body)["spec"]) == parse_spec("run", prune_nulls(body["spec"]))


def test_a_minimal_spec_stored_with_defaults_is_complete() -> None:
    stored = as_stored(rlrun("run", {"model": {"name": "m", "preset": "qwen2_vl"}}))["spec"]
    assert stored["inference"]["resources"] == {"requests": {"cpu": "4", "memory": "16Gi"}}
    assert stored["orchestrator"]["sampling"] == {"temperature": 1.0, "topP": 1.0}
    assert stored["offload"]["accessMode"] == "ReadWriteMany"
    assert parse_spec("run", stored) == parse_spec("run", {"model": {"name": "m", "preset": "qwen2_vl"}})


def example_bodies() -> list[tuple[str, dict[str, Any]]]:
    bodies = [(f"sample:{name}", rlrun("run", spec)) for name, spec in SPECS.items()]
    for path in sorted((REPO / "manifests" / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "RLRun":
                bodies.append((path.name, doc))
    return bodies


@pytest.mark.parametrize(("source", "body"), example_bodies(), ids=[s for s, _ in example_bodies()])
def test_examples_validate_against_the_crd_schema_and_the_models(source: str, body: dict[str, Any]) -> None:
    jsonschema.Draft4Validator(open_api_schema()).validate(as_stored(body))
    parse_spec(body["metadata"]["name"], prune_nulls(body["spec"]))


@pytest.mark.parametrize(
    ("patch", "path"),
    [
        ({"inference": {"replicas": 0}}, ["spec", "inference", "replicas"]),
        ({"inference": {"materializeCacheSize": "2GB"}}, ["spec", "inference", "materializeCacheSize"]),
        ({"orchestrator": {"sampling": {"topP": 0}}}, ["spec", "orchestrator", "sampling", "topP"]),
        ({"model": {"preset": "llava"}}, ["spec", "model", "preset"]),
        ({"trainer": {"missingImagePolicy": "skip"}}, ["spec", "trainer", "missingImagePolicy"]),
    ],
)
def test_schema_rejects_out_of_range_values(patch: dict[str, Any], path: list[str]) -> None:
    body = rlrun("run", SPECS["issue-example"])
    for key, value in patch.items():
        body["spec"][key] = {**body["spec"][key], **value}
    errors = list(jsonschema.Draft4Validator(open_api_schema()).iter_errors(as_stored(body)))
    assert [list(e.absolute_path) for e in errors] == [path]


# --- CEL rules, evaluated with a CEL interpreter (the API server evaluates the same text) ---


def cel_rules(node: dict[str, Any]) -> list[dict[str, str]]:
    return node.get("x-kubernetes-validations", [])


def _quantity(text: Any) -> celpy.celtypes.IntType:
    return celpy.celtypes.IntType(parse_byte_size(str(text)))


def _compare_to(a: Any, b: Any) -> celpy.celtypes.IntType:
    return celpy.celtypes.IntType((a > b) - (a < b))


# Kubernetes' CEL quantity library, for byte sizes (the server has the real one; the real-server tests
# in test_real_operator_* prove the rules there).
CEL_LIBRARY = {"quantity": _quantity, "compareTo": _compare_to}


def evaluate(rule: str, self_value: Any, old_value: Any = None) -> bool:
    """The rule's value; raises where the server would report an error (a missing key, a bad type)."""
    env = celpy.Environment()
    activation = {"self": celpy.json_to_cel(self_value)}
    if old_value is not None:
        activation["oldSelf"] = celpy.json_to_cel(old_value)
    result = env.program(env.compile(rule), functions=CEL_LIBRARY).evaluate(activation)
    assert isinstance(result, celpy.celtypes.BoolType), f"{rule} gave {result!r}"
    return bool(result)


def rule_nodes(node: dict[str, Any], path: tuple[str, ...] = ()) -> Any:
    """(path of property names, schema node) of every node that carries CEL rules."""
    if cel_rules(node):
        yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from rule_nodes(sub, (*path, name))


def at(value: Any, path: tuple[str, ...]) -> Any:
    for name in path:
        value = value[name]
    return value


@pytest.mark.parametrize(("source", "body"), example_bodies(), ids=[s for s, _ in example_bodies()])
def test_every_cel_rule_is_safe_on_the_object_as_stored(source: str, body: dict[str, Any]) -> None:
    """An error in a rule rejects the object: every rule must evaluate (to true, for these valid specs) on
    the object the server stores, where an optional field without a default is absent. Also on update
    (self == oldSelf) for the transition rules."""
    stored = as_stored(body)
    evaluated = 0
    for path, node in rule_nodes(open_api_schema()):
        value = at(stored, path)
        for rule in cel_rules(node):
            old = value if "oldSelf" in rule["rule"] else None
            assert evaluate(rule["rule"], value, old), (path, rule["message"])
            evaluated += 1
    assert evaluated >= 8


def test_every_cel_rule_holds_on_its_nodes_default_as_written() -> None:
    """kube-apiserver refuses a CRD whose defaults fail its own rules, evaluated on the default value as
    written (nested defaults not applied): a `default: {}` under a rule reading `self.engine` is refused."""
    checked = 0
    for path, node in rule_nodes(open_api_schema()):
        if "default" not in node:
            continue
        for rule in cel_rules(node):
            old = node["default"] if "oldSelf" in rule["rule"] else None
            assert evaluate(rule["rule"], node["default"], old), (path, rule["message"])
            checked += 1
    assert checked >= 5


def test_the_cpu_quickstart_passes_without_extra_args() -> None:
    """The defect the real server showed: `size(self.extraArgs)` on a spec that has none."""
    (body,) = [b for s, b in example_bodies() if s == "tiny-cpu.yaml"]
    assert "extraArgs" not in body["spec"]["inference"]
    inference = as_stored(body)["spec"]["inference"]
    assert "extraArgs" not in inference  # no schema default: absent as stored
    for rule in cel_rules(open_api_schema()["properties"]["spec"]["properties"]["inference"]):
        assert evaluate(rule["rule"], inference), rule["message"]


def test_every_cel_rule_compiles() -> None:
    env = celpy.Environment()
    rules = [rule for _, node in schema_nodes(open_api_schema()) for rule in cel_rules(node)]
    assert len(rules) >= 7
    for rule in rules:
        env.compile(rule["rule"])


def test_inference_cel_rules_agree_with_the_operator_checks() -> None:
    node = open_api_schema()["properties"]["spec"]["properties"]["inference"]
    cel = {rule["message"]: rule["rule"] for rule in cel_rules(node)}
    python = {rule.message: rule for rule in InferenceSpec.rules if rule.cel}
    assert set(cel) == set(python)
    grid = itertools.product(
        ["vllm", "transformers"], [0, 1, 2, 4], [1, 2, 4, 8], [[], ["--enforce-eager"]], ["", "cpu:1"]
    )
    for engine, gpus, tp, extra, image in grid:
        raw = apply_schema_defaults(
            node,
            {"engine": engine, "gpus": gpus, "tensorParallelSize": tp, "extraArgs": extra, "image": image},
        )
        model = SimpleNamespace(
            engine=engine, gpus=gpus, tensor_parallel_size=tp, extra_args=extra, image=image
        )
        for message, rule in python.items():
            assert evaluate(cel[message], raw) == rule.holds(model), (message, engine, gpus, tp)


@pytest.mark.parametrize(
    "name",
    [
        "shapes",
        "shapes-multiturn",
        "colours",
        "pkg.envs:Env",
        "e:make",
        "shapes_multiturn",
        "pkg.envs",
        "a:b.c",
        ":x",
    ],
)
def test_the_environment_name_rule_agrees_with_the_run_config(name: str) -> None:
    """kubectl apply refuses exactly the names the run config (and so the operator) would."""
    from rawmm.config import environment_name_problem

    node = open_api_schema()["properties"]["spec"]["properties"]["orchestrator"]["properties"]["environment"]
    (rule,) = cel_rules(node)
    assert evaluate(rule["rule"], {"name": name}) == (environment_name_problem(name) is None)


def test_model_and_claim_are_immutable_but_the_rest_may_change() -> None:
    spec = open_api_schema()["properties"]["spec"]
    (model_rule,) = cel_rules(spec["properties"]["model"])
    old_model = {"name": "a", "preset": "qwen2_vl"}
    assert evaluate(model_rule["rule"], old_model, old_model)
    assert not evaluate(model_rule["rule"], {**old_model, "name": "b"}, old_model)

    offload_rules = [r["rule"] for r in cel_rules(spec["properties"]["offload"])]
    old = apply_schema_defaults(spec["properties"]["offload"], {"existingClaim": "shared"})

    def allowed(new: dict[str, Any]) -> bool:
        return all(evaluate(rule, new, old) for rule in offload_rules)

    assert allowed({**old, "retainOnDelete": False, "size": "500Gi"})
    assert not allowed({**old, "existingClaim": "other"})
    assert not allowed({k: v for k, v in old.items() if k != "existingClaim"})
    assert not allowed({**old, "storageClassName": "fast"})
    assert not allowed({**old, "accessMode": "ReadWriteOnce"})


@pytest.mark.parametrize(
    ("old", "new", "ok"),
    [
        ("100Gi", "100Gi", True),
        ("100Gi", "200Gi", True),
        ("100Gi", "1Ti", True),
        ("100Gi", "99Gi", False),
        ("1Ti", "1000Gi", False),
        ("100Gi", "107374182400", True),
    ],
)
def test_offload_size_may_grow_but_never_shrink(old: str, new: str, ok: bool) -> None:
    node = open_api_schema()["properties"]["spec"]["properties"]["offload"]
    (rule,) = [r for r in cel_rules(node) if r["message"] == "offload.size cannot shrink"]
    before = apply_schema_defaults(node, {"size": old})
    assert evaluate(rule["rule"], {**before, "size": new}, before) is ok


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("a" * 40, True),
        ("exp-1", True),
        ("a" * 41, False),
        ("my.run", False),
        ("1run", False),
        ("Run", False),
        ("run-", False),
    ],
)
def test_run_names_are_dns_1035_labels_in_the_schema(name: str, ok: bool) -> None:
    """A name with a dot is a valid RLRun name for Kubernetes but not a Service name: the schema refuses it."""
    body = rlrun(name, SPECS["cpu-only"])
    errors = list(jsonschema.Draft4Validator(open_api_schema()).iter_errors(as_stored(body)))
    assert (not errors) is ok, [e.message for e in errors]
    assert (run_name_problem(name) is None) is ok


def test_read_write_once_pod_is_refused_and_read_write_once_needs_one_trainer_node() -> None:
    schema = open_api_schema()
    modes = schema["properties"]["spec"]["properties"]["offload"]["properties"]["accessMode"]["enum"]
    assert modes == ["ReadWriteMany", "ReadWriteOnce"]
    (rule,) = [r for r in cel_rules(schema["properties"]["spec"]) if "ReadWriteOnce" in r["message"]]
    for mode, nodes, ok in [
        ("ReadWriteOnce", 1, True),
        ("ReadWriteOnce", 2, False),
        ("ReadWriteMany", 4, True),
    ]:
        stored = as_stored(
            rlrun(
                "run",
                merged(SPECS["multi-node"], {"offload": {"accessMode": mode}, "trainer": {"nodes": nodes}}),
            )
        )
        assert evaluate(rule["rule"], stored["spec"]) is ok


def test_the_trainer_metrics_port_may_not_be_torchruns() -> None:
    schema = open_api_schema()
    (rule,) = [r for r in cel_rules(schema["properties"]["spec"]) if "torchrun" in r["message"]]
    for port, ok in [(29500, False), (9102, True), (29501, True)]:
        stored = as_stored(
            rlrun("run", merged(SPECS["multi-node"], {"monitoring": {"trainerMetricsPort": port}}))
        )
        assert evaluate(rule["rule"], stored["spec"]) is ok


def test_the_broadcast_rules_agree_with_the_operator_checks_and_the_run_config() -> None:
    """broadcast is accepted on the cluster now, with either engine (a vLLM replica of one worker: as the run
    config wants) and with the trainer's metrics off its rendezvous port; the old "local runs only" and
    "transformers engine only" refusals are gone."""
    from rawmm.config import ConfigError, RunConfig

    rules = cel_rules(open_api_schema()["properties"]["spec"])
    assert not [r for r in rules if "local runs" in r["message"]]
    assert not [r for r in rules if "needs inference.engine transformers" in r["message"]]
    cel = {r["message"]: r["rule"] for r in rules if "weightTransfer" in r["rule"]}
    python = {r.message: r for r in RLRunSpec.rules if r.cel and "weightTransfer" in r.cel}
    assert set(cel) == set(python) and len(cel) == 2
    grid = itertools.product(
        [None, "checkpoint", "broadcast"], ["vllm", "transformers"], [9102, 29501], [1, 2]
    )
    for transfer, engine, port, parallel in grid:
        patch: dict[str, Any] = {
            "inference": {"engine": engine, "tensorParallelSize": parallel},
            "monitoring": {"trainerMetricsPort": port},
        }
        stored = as_stored(rlrun("run", merged(SPECS["cpu-only"], patch)))["spec"]
        if transfer is None:
            del stored["trainer"]["weightTransfer"]  # the guard: an object without it
        else:
            stored["trainer"]["weightTransfer"] = transfer
        model = SimpleNamespace(
            trainer=SimpleNamespace(weight_transfer=transfer or "checkpoint"),
            inference=SimpleNamespace(engine=engine, tensor_parallel_size=parallel),
            monitoring=SimpleNamespace(trainer_metrics_port=port),
        )
        for message, rule in python.items():
            assert evaluate(cel[message], stored) == rule.holds(model), (
                message,
                transfer,
                engine,
                port,
                parallel,
            )
        if engine != "vllm":
            continue  # tensorParallelSize is a vLLM argument (another rule refuses it with transformers)
        # the runs the run config refuses (from the vLLM arguments the operator derives) are exactly the
        # ones the engine rule refuses
        (engine_rule,) = [r for m, r in python.items() if "engine" in m]
        data = {
            "model": {"path": "m", "preset": "qwen2_vl"},
            "shared_dir": "/s",
            "inference": {"engine": engine, "vllm_args": ["--tensor-parallel-size", str(parallel)]},
            "trainer": {"weight_transfer": transfer or "checkpoint"},
        }
        try:
            RunConfig.from_mapping(data)
            accepted = True
        except ConfigError:
            accepted = False
        assert accepted == engine_rule.holds(model), (transfer, engine, parallel)


def trainer_rule(naming: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The trainer's schema node and its one CEL rule that names `naming`."""
    node = open_api_schema()["properties"]["spec"]["properties"]["trainer"]
    (rule,) = [r for r in cel_rules(node) if naming in r["rule"]]
    return node, rule


def test_trainer_seq_len_rule_agrees_with_the_run_config() -> None:
    node, rule = trainer_rule("seqLen")
    for seq_len, micro in [(512, 512), (1024, 512), (2048, 4096)]:
        raw = apply_schema_defaults(node, {"seqLen": seq_len, "microBatchTokens": micro})
        assert evaluate(rule["rule"], raw) == (seq_len <= micro)
    # defaults alone (seqLen 2048, microBatchTokens 4096) pass
    assert evaluate(rule["rule"], apply_schema_defaults(node, {}))


def test_trainer_checkpoint_every_rule_agrees_with_the_run_config() -> None:
    node, rule = trainer_rule("checkpointEvery")
    for every, transfer in itertools.product((1, 3), ("checkpoint", "broadcast")):
        raw = apply_schema_defaults(node, {"checkpointEvery": every, "weightTransfer": transfer})
        try:
            TrainerConfig(checkpoint_every=every, weight_transfer=transfer)
            accepted = True
        except ValidationError:
            accepted = False
        assert evaluate(rule["rule"], raw) == accepted == (every == 1 or transfer == "broadcast")
    assert evaluate(rule["rule"], apply_schema_defaults(node, {}))  # the defaults pass
