"""`make images` (tools/images/build.sh): what decides whether make builds an image again."""

from __future__ import annotations

import re
import subprocess
import time

from kube.images import BUILT
from kube.node import REPO


def test_an_image_archive_is_dated_when_its_build_read_the_sources() -> None:
    """make builds an image again when a source is newer than its archive. A build reads the sources first
    and writes the archive minutes later: dated then, it would hide an edit made meanwhile (the image
    holding the old source, make calling it up to date). Dated at the build's start, that edit is newer."""
    before = time.time()
    built = subprocess.run(
        [str(REPO / "tools" / "images" / "build.sh"), "operator"],
        check=True,
        timeout=900,
        capture_output=True,
        text=True,
    )
    after = time.time()
    written = (BUILT / "rawmm-operator.tar").stat().st_mtime
    # The script's own clock, in whole seconds: "<tag>: <size>, built in N s", N from its start to its end.
    took = int(re.findall(r"built in (\d+) s", built.stdout)[-1])
    # (a cached build still takes ~3 s to push the archive, so an archive dated at the end is caught)
    assert int(before) <= written <= after - took + 1, (before, written, after, took)
