"""The generated files (the CRD in manifests/ and in the chart, manifests/install.yaml) match their
sources: the operator's pydantic models and the chart. `python manifests/generate.py` fixes a failure."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from chart_generate import load_generate
from chart_helpers import KUBE_VERSIONS, validate_object

generate = load_generate()


@pytest.fixture(scope="module")
def expected() -> dict[Path, str]:
    return generate.generated_files()


def test_generated_files_are_up_to_date(expected: dict[Path, str]) -> None:
    stale = [
        str(path.relative_to(generate.REPO)) for path, text in expected.items() if path.read_text() != text
    ]
    assert not stale, f"out of date, run `python manifests/generate.py`: {stale}"


def test_crd_in_manifests_and_in_install_yaml_is_the_pydantic_one() -> None:
    from rawmm_operator.crd import crd_manifest

    source = crd_manifest()
    assert yaml.safe_load(generate.CRD_MANIFEST.read_text()) == source
    installed = [d for d in yaml.safe_load_all(generate.INSTALL_MANIFEST.read_text()) if d]
    (crd,) = [d for d in installed if d["kind"] == "CustomResourceDefinition"]
    assert crd["spec"] == source["spec"]


def test_install_yaml_is_the_default_rendering_for_a_bare_cluster_in_apply_order() -> None:
    docs = [d for d in yaml.safe_load_all(generate.INSTALL_MANIFEST.read_text()) if d]
    rendered = [doc.body for doc in generate.render_chart(api_versions=())]
    assert docs[0] == {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": generate.INSTALL_NAMESPACE},
    }
    assert sorted(map(repr, docs[1:])) == sorted(map(repr, rendered))
    kinds = [d["kind"] for d in docs]
    assert kinds.index("CustomResourceDefinition") < kinds.index("Deployment")
    assert kinds.index("ServiceAccount") < kinds.index("Deployment")
    assert {d["metadata"].get("namespace") for d in docs[1:]} <= {generate.INSTALL_NAMESPACE, None}
    # it applies where the prometheus-operator CRDs are not installed
    assert not [d for d in docs if d["apiVersion"].startswith("monitoring.coreos.com/")]


def test_monitoring_yaml_holds_the_monitoring_objects_of_the_default_rendering() -> None:
    docs = [d for d in yaml.safe_load_all(generate.MONITORING_MANIFEST.read_text()) if d]
    assert sorted(d["kind"] for d in docs) == ["PrometheusRule", "ServiceMonitor"]
    with_operator = [doc.body for doc in generate.render_chart()]
    assert sorted(map(repr, docs)) == sorted(
        repr(d) for d in with_operator if d["apiVersion"] == "monitoring.coreos.com/v1"
    )
    # both files together are the rendering for a cluster with the prometheus-operator
    install = [d for d in yaml.safe_load_all(generate.INSTALL_MANIFEST.read_text()) if d][1:]
    assert sorted(map(repr, install + docs)) == sorted(map(repr, with_operator))


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_install_yaml_validates_strictly(kube_version: str) -> None:
    for path in (generate.INSTALL_MANIFEST, generate.MONITORING_MANIFEST):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                validate_object(doc, kube_version)


def test_check_mode_reports_a_stale_file_and_write_mode_fixes_it(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    expected: dict[Path, str],
) -> None:
    # The generator writes into tmp_path here, never into the repository.
    wanted_install = expected[generate.INSTALL_MANIFEST]
    for name in ("CRD_MANIFEST", "CRD_TEMPLATE", "INSTALL_MANIFEST", "MONITORING_MANIFEST"):
        target = tmp_path / name
        target.write_text(expected[getattr(generate, name)])
        monkeypatch.setattr(generate, name, target)
    monkeypatch.setattr(generate, "REPO", tmp_path)  # paths are printed relative to REPO
    generate.INSTALL_MANIFEST.write_text("# edited by hand\n")
    assert generate.main(["--check"]) == 1
    assert capsys.readouterr().err.split(":", 1)[1].split() == ["INSTALL_MANIFEST"]
    assert generate.INSTALL_MANIFEST.read_text() == "# edited by hand\n"
    assert generate.main([]) == 0
    assert generate.main(["--check"]) == 0
    assert generate.INSTALL_MANIFEST.read_text() == wanted_install


def test_a_template_action_in_the_crd_text_renders_literally(tmp_path: Path) -> None:
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "things.example.com"},
        "spec": {"description": "use {{ braces }} freely"},
    }
    chart_dir = tmp_path / "rawmm"
    shutil.copytree(generate.CHART_DIR, chart_dir)
    (chart_dir / generate.CRD_TEMPLATE_IN_CHART).write_text(generate.crd_template_text(crd))
    (rendered,) = [
        d.body for d in generate.render_chart(chart_dir=chart_dir) if d.kind == "CustomResourceDefinition"
    ]
    assert rendered["spec"] == {"description": "use {{ braces }} freely"}
