"""The image-format allow-list: vLLM's own, refusing at ingest what vLLM would refuse to open."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import pytest
from PIL import Image, UnidentifiedImageError

from rawmm.contract import ImageIngestError, OffloadStore
from rawmm.contract.formats import ALLOWED_IMAGE_FORMATS, DeniedImageFormat, open_allowed

# The first bytes by which PIL's plugin for each denied format recognises a file (EPS: a real one, below).
DENIED_PREFIXES = {
    "WMF": b"\xd7\xcd\xc6\x9a\x00\x00",
    "GRIB": b"GRIB\x00\x00\x00\x01",
    "HDF5": b"\x89HDF\r\n\x1a\n",
    "MPEG": b"\x00\x00\x01\xb3",
    "BUFR": b"BUFR",
}


def red_4x3(fmt: str) -> bytes:
    """A 4x3 red image as PIL writes ``fmt``."""
    buffer = io.BytesIO()
    Image.new("RGB", (4, 3), "red").save(buffer, format=fmt)
    return buffer.getvalue()


def eps_bytes() -> bytes:
    """A real 4x3 EPS, as PIL writes one (header, bounding box and the pixels as PostScript)."""
    return red_4x3("EPS")


def denied_files() -> dict[str, bytes]:
    return {
        "EPS": eps_bytes(),
        **{name: prefix.ljust(64, b"\x00") for name, prefix in DENIED_PREFIXES.items()},
    }


def test_the_list_is_the_installed_vllms() -> None:
    from vllm.multimodal.image import ALLOWED_IMAGE_FORMATS as VLLM_ALLOWED

    assert ALLOWED_IMAGE_FORMATS == VLLM_ALLOWED


def test_pil_reads_the_eps_without_the_list() -> None:
    # What the list guards against: without it PIL takes the file as EPS (and decoding it runs Ghostscript).
    assert Image.open(io.BytesIO(eps_bytes())).format == "EPS"


@pytest.mark.parametrize("name", sorted(denied_files()))
def test_a_denied_format_is_refused_by_name_as_vllm_refuses_it(name: str) -> None:
    from vllm.multimodal.image import open_image as vllm_open_image

    data = denied_files()[name]
    with pytest.raises(DeniedImageFormat, match=f"^{name} is not an allowed image format"):
        open_allowed(data)
    with pytest.raises(UnidentifiedImageError):
        vllm_open_image(io.BytesIO(data))


def test_a_file_in_a_denied_format_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "x.png"
    path.write_bytes(eps_bytes())
    with pytest.raises(DeniedImageFormat, match="^EPS is not an allowed"):
        open_allowed(path)


def test_bytes_no_plugin_knows_are_unidentified_not_denied() -> None:
    with pytest.raises(UnidentifiedImageError) as excinfo:
        open_allowed(b"definitely not an image")
    assert not isinstance(excinfo.value, DeniedImageFormat)


def test_a_pillow_without_a_listed_reader_still_opens_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    # Pillow before 11.2 has no AVIF reader; Image.open would raise KeyError on reaching it in the list
    # (a TIFF is tried after AVIF).
    Image.init()
    monkeypatch.delitem(Image.OPEN, "AVIF")
    with open_allowed(red_4x3("TIFF")) as image:
        assert image.format == "TIFF"


def test_a_plugin_check_that_explains_itself_is_not_a_match(monkeypatch: pytest.MonkeyPatch) -> None:
    # PIL reads a string from a plugin's check as "not this format" (a warning), and so do we.
    Image.init()
    factory, _ = Image.OPEN["EPS"]
    monkeypatch.setitem(Image.OPEN, "EPS", (factory, lambda prefix: "looks like EPS, is not"))
    with pytest.raises(UnidentifiedImageError) as excinfo:
        open_allowed(eps_bytes())
    assert not isinstance(excinfo.value, DeniedImageFormat)


@pytest.mark.parametrize("fmt", ["PNG", "BMP", "TIFF", "WEBP"])
def test_allowed_formats_open(fmt: str, tmp_path: Path) -> None:
    data = red_4x3(fmt)
    path = tmp_path / "image"
    path.write_bytes(data)
    for source in (data, path):
        with open_allowed(source) as image:
            assert (image.format, image.size) == (fmt, (4, 3))


def test_ingest_refuses_a_denied_format_and_stores_nothing(offload_store: OffloadStore) -> None:
    with pytest.raises(ImageIngestError, match="not a readable image: EPS is not an allowed image format"):
        offload_store.put(eps_bytes())
    assert not any(p.is_file() for p in offload_store.root.rglob("*"))


def test_ingest_refuses_a_denied_format_under_a_stored_name(offload_store: OffloadStore) -> None:
    # A rogue writer's EPS named as the store names a PNG: re-putting its URI opens it where it lies.
    data = eps_bytes()
    sha = hashlib.sha256(data).hexdigest()
    path = offload_store.root / sha[:2] / f"{sha}.png"
    path.parent.mkdir()
    path.write_bytes(data)
    with pytest.raises(ImageIngestError, match=f"stored file {path} is not a readable image: EPS is not"):
        offload_store.put(f"file://{path}")


def test_a_png_is_opened_without_trying_other_plugins_first(monkeypatch: pytest.MonkeyPatch) -> None:
    # PIL tries a format list in the order given; IMT has no byte check, so trying it parses the header.
    Image.init()
    tried: list[str] = []
    factory, accept = Image.OPEN["IMT"]
    monkeypatch.setitem(Image.OPEN, "IMT", (lambda *args: tried.append("IMT") or factory(*args), accept))
    with open_allowed(red_4x3("PNG")) as image:
        assert image.format == "PNG" and tried == []
