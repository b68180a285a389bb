"""`rawmm ingest`: all or nothing (every file fully decoded first), and quiet when its reader goes away."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from rawmm.cli import main


def png(width: int = 40, height: int = 30, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def stored_files(root: Path) -> list[Path]:
    return [path for path in root.rglob("*") if path.is_file()] if root.exists() else []


def test_a_truncated_png_is_refused_and_not_stored(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    whole = png()
    truncated = tmp_path / "cut.png"
    truncated.write_bytes(whole[: len(whole) // 2])  # the header still reads: only a full decode tells
    assert main(["ingest", str(truncated), "--offload-root", str(tmp_path / "store")]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(f"rawmm ingest: error: {truncated} is not a decodable image: ")
        and err.count("\n") == 1
    )
    assert stored_files(tmp_path / "store") == []


def test_a_folder_with_bad_files_lists_every_one_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "shots"
    folder.mkdir()
    (folder / "a.png").write_bytes(png())
    (folder / "b.png").write_bytes(png(seed=1)[:60])
    (folder / "c.png").write_bytes(b"not an image at all")
    (folder / "d.png").write_bytes(png(3, 1000))  # decodes, but Qwen has no layout for it (aspect > 200)
    code = main(["ingest", str(folder), "--offload-root", str(tmp_path / "store"), "--preset", "qwen2_vl"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert [line.split()[0].removesuffix(":") for line in lines[:-1]] == [
        str(folder / name) for name in ("b.png", "c.png", "d.png")
    ]
    assert lines[-1] == "rawmm ingest: error: 3 of 4 files cannot be ingested; nothing was written"
    assert stored_files(tmp_path / "store") == []


def test_a_reader_that_goes_away_ends_the_ingest_quietly(tmp_path: Path) -> None:
    for i in range(3):
        (tmp_path / f"{i}.png").write_bytes(png(seed=i))
    argv = [sys.executable, "-m", "rawmm.cli", "ingest", str(tmp_path), "--offload-root", str(tmp_path / "s")]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()  # as `| head` does once it has what it wants: here before the first line
    err = process.stderr.read().decode()
    assert process.wait(timeout=60) == 141
    assert err == ""  # no BrokenPipeError traceback, no "Exception ignored" at exit
