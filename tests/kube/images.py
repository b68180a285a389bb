"""The real node's small images, made here (nothing is pulled): OCI image archives of one layer, imported
into the node's containerd with `ctr images import` (node.import_images).

- `PAUSE_IMAGE`: the pod sandbox, the pause program built from tools/k8s/pause.
- `BUSYBOX_IMAGE`: Debian's busybox-static (its applets as symlinks), for pods that only need a shell, a
  web server (httpd), wget, nc and nslookup.
- `built()`: the rawmm images of images/*/Dockerfile that `make images` built with buildah; the node imports
  `NODE_START_IMAGES` when it starts, the others when a test asks.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kube.node import DEBS, K8S, REPO

BUILT = REPO / ".tools" / "images"  # `make images` (tools/images/build.sh): rawmm-<name>.tar

PAUSE_IMAGE = "rawmm.test/pause:1"
BUSYBOX_IMAGE = "rawmm.test/busybox:1.35"
BUSYBOX_APPLETS = ("sh", "cat", "echo", "hostname", "httpd", "ls", "mkdir", "nc", "nslookup", "sleep", "wget")


def _add_file(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o755) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    tar.addfile(info, io.BytesIO(data))


def _add_dir(tar: tarfile.TarFile, name: str, mode: int = 0o755) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.mode = tarfile.DIRTYPE, mode
    tar.addfile(info)


def _add_link(tar: tarfile.TarFile, name: str, target: str) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    tar.addfile(info)


def _blob(tar: tarfile.TarFile, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    _add_file(tar, f"blobs/sha256/{digest}", data, 0o644)
    return f"sha256:{digest}"


def write_oci_archive(path: Path, name: str, layer: bytes, config: dict[str, Any]) -> Path:
    """An OCI image layout tarball (one uncompressed layer) that `ctr images import` names `name`."""
    image_config = {
        "architecture": "amd64",
        "os": "linux",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{hashlib.sha256(layer).hexdigest()}"]},
    }
    with tarfile.open(path, "w") as tar:
        _add_file(tar, "oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode(), 0o644)
        layer_digest = _blob(tar, layer)
        config_bytes = json.dumps(image_config).encode()
        config_digest = _blob(tar, config_bytes)
        manifest = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {
                    "mediaType": "application/vnd.oci.image.config.v1+json",
                    "digest": config_digest,
                    "size": len(config_bytes),
                },
                "layers": [
                    {
                        "mediaType": "application/vnd.oci.image.layer.v1.tar",
                        "digest": layer_digest,
                        "size": len(layer),
                    }
                ],
            }
        ).encode()
        manifest_digest = _blob(tar, manifest)
        index = {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": manifest_digest,
                    "size": len(manifest),
                    "annotations": {
                        "io.containerd.image.name": name,
                        "org.opencontainers.image.ref.name": name.rsplit(":", 1)[1],
                    },
                }
            ],
        }
        _add_file(tar, "index.json", json.dumps(index).encode(), 0o644)
    return path


def _layer(build: Any) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        build(tar)
    return buffer.getvalue()


def pause_archive(directory: Path) -> Path:
    def build(tar: tarfile.TarFile) -> None:
        _add_file(tar, "pause", (K8S / "pause").read_bytes())

    return write_oci_archive(
        directory / "pause.tar", PAUSE_IMAGE, _layer(build), {"Entrypoint": ["/pause"], "User": "65535:65535"}
    )


def busybox_archive(directory: Path) -> Path:
    def build(tar: tarfile.TarFile) -> None:
        for name in ("bin", "etc", "www"):
            _add_dir(tar, name)
        _add_dir(tar, "tmp", 0o1777)
        _add_file(tar, "bin/busybox", (DEBS / "bin/busybox").read_bytes())
        for applet in BUSYBOX_APPLETS:
            _add_link(tar, f"bin/{applet}", "busybox")
        _add_file(
            tar, "etc/passwd", b"root:x:0:0:root:/:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/sh\n", 0o644
        )
        _add_file(tar, "etc/group", b"root:x:0:\nnogroup:x:65534:\n", 0o644)

    return write_oci_archive(
        directory / "busybox.tar",
        BUSYBOX_IMAGE,
        _layer(build),
        {"Cmd": ["/bin/sh"], "Env": ["PATH=/bin"], "WorkingDir": "/"},
    )


# What the node imports when it starts: the operator's image is small; the run images (trainer, CPU
# inference: GBs, minutes to import) are imported by the tests that run them (`KubeCluster.import_images`).
NODE_START_IMAGES = ("operator",)


def built(names: Iterable[str] | None = None) -> list[Path]:
    """The docker-archives of the rawmm images `make images` built (images/<name>/Dockerfile): those of
    `names` that exist, or all of them."""
    if names is None:
        return sorted(BUILT.glob("rawmm-*.tar"))
    return [path for name in names if (path := BUILT / f"rawmm-{name}.tar").is_file()]
