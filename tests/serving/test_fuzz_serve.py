"""Fuzzing the whole request surface of a real `rawmm serve` (transformers engine, tiny Qwen2-VL): whatever a
client sends, the answer is a 200 or a 4xx whose body names a machine-readable reason, never a 500.

Three generators: real odd images behind correct refs (extreme aspect ratios, 1-px sides, palette, alpha,
16-bit, CMYK, animated), hostile ref text (URIs with lone surrogates, over-long paths, escapes, mutated
fields), and arbitrary body structure (generate and weights routes). `make test` runs a small count;
``RAWMM_FUZZ_EXAMPLES=N`` runs N examples per generator for a soak.
"""

from __future__ import annotations

import io
import json
import os
import re
from typing import Any

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from serve_harness import MAX_IMAGE_PIXELS, WEIGHTS_TOKEN, Server, picture, user

from rawmm.contract import RawImageDescriptor, describe_stored_image, encode_ref, get_family

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("RAWMM_FUZZ_EXAMPLES", "30"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize="RAWMM_FUZZ_EXAMPLES" not in os.environ,  # CI: the same examples every run; soak: new ones
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
REASON = re.compile(r"[a-z][a-z0-9_]*")


def assert_answered(response: httpx.Response, *, allowed: tuple[int, ...] = (200, 400)) -> dict[str, Any]:
    """A 200, or an allowed 4xx whose body is ``{"error": {"type", "reason", "message"}}``."""
    assert response.status_code in allowed, response.text
    body = response.json()
    if response.status_code >= 400:
        error = body["error"]
        assert REASON.fullmatch(error["type"]) and REASON.fullmatch(error["reason"]), error
        assert isinstance(error["message"], str) and error["message"], error
    return body


# --- real odd images behind correct refs -------------------------------------------------------------------


def encode(mode: str, width: int, height: int, fmt: str, seed: int, frames: int = 1) -> bytes:
    """A real image file: noise in ``mode``, ``frames`` > 1 writes an animation."""
    rng = np.random.default_rng(seed)

    def frame() -> Image.Image:
        rgb = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        if mode == "P+transparency":
            image = rgb.convert("P")
            image.info["transparency"] = 0
            return image
        if mode in ("I;16", "I"):
            return Image.fromarray(rng.integers(0, 65536, (height, width), dtype=np.uint16)).convert(mode)
        if mode == "F":
            return Image.fromarray(rng.random((height, width), dtype=np.float32))
        return rgb.convert(mode)

    images = [frame() for _ in range(frames)]
    out = io.BytesIO()
    if frames > 1:
        images[0].save(out, format=fmt, save_all=True, append_images=images[1:], duration=40, loop=0)
    else:
        images[0].save(out, format=fmt)
    return out.getvalue()


# The cases, named, plus the odd modes each format can hold.
ODD_IMAGES: dict[str, tuple[str, int, int, str, int]] = {
    "3x1000 (aspect 333)": ("RGB", 3, 1000, "PNG", 1),
    "1000x3 (aspect 333)": ("RGB", 1000, 3, "PNG", 1),
    "1x1": ("RGB", 1, 1, "PNG", 1),
    "1x150": ("L", 1, 150, "PNG", 1),
    "200x1 (aspect exactly 200)": ("RGB", 200, 1, "PNG", 1),
    "201x1": ("RGB", 201, 1, "PNG", 1),
    "palette": ("P", 40, 30, "PNG", 1),
    "palette with transparency": ("P+transparency", 40, 30, "PNG", 1),
    "bilevel": ("1", 33, 17, "PNG", 1),
    "grey + alpha": ("LA", 40, 30, "PNG", 1),
    "rgba": ("RGBA", 40, 30, "PNG", 1),
    "16-bit grey": ("I;16", 40, 30, "PNG", 1),
    "32-bit int tiff": ("I", 40, 30, "TIFF", 1),
    "float tiff": ("F", 40, 30, "TIFF", 1),
    "cmyk jpeg": ("CMYK", 40, 30, "JPEG", 1),
    "grey jpeg": ("L", 40, 30, "JPEG", 1),
    "animated gif": ("P", 40, 30, "GIF", 3),
    "animated png": ("RGBA", 40, 30, "PNG", 3),
    "animated webp": ("RGB", 40, 30, "WEBP", 3),
    "bmp": ("RGB", 40, 30, "BMP", 1),
    "over the pixel limit": ("RGB", 501, 500, "PNG", 1),
}
FORMAT_MODES = {
    "PNG": ["1", "L", "LA", "P", "P+transparency", "RGB", "RGBA", "I;16"],
    "JPEG": ["L", "RGB", "CMYK"],
    "GIF": ["L", "P"],
    "WEBP": ["RGB", "RGBA"],
    "TIFF": ["1", "L", "RGB", "CMYK", "I", "F"],
    "BMP": ["1", "L", "P", "RGB"],
}


def expected_outcome(server: Server, width: int, height: int) -> str | None:
    """None when the image must be served, else the reason it must be refused with."""
    if width * height > MAX_IMAGE_PIXELS:
        return "image_too_large"
    try:
        get_family("qwen_vl").describe(width=width, height=height, config=server.config)
    except ValueError:  # no layout, e.g. an aspect ratio over Qwen's 200
        return "image_too_large"
    return None


def request_for(server: Server, data: bytes) -> tuple[list[int], dict[str, Any], int, int]:
    """A prompt with one image and the correct ref to the stored ``data`` (a best guess of the grid when the
    image has no layout: the server must refuse it whatever the ref claims)."""
    family = get_family("qwen_vl")
    stored = server.store.put(data)
    try:
        descriptor, layout = describe_stored_image(family, server.config, stored, fingerprint=None)
        length = layout.num_placeholder_tokens
    except ValueError:
        descriptor = RawImageDescriptor("qwen_vl", "image", {"image_grid_thw": [[1, 2, 2]]}, stored.uri)
        length = 1
    pad = server.tokenizer.convert_tokens_to_ids(family.placeholder_token)
    token_ids = [1, 2, *([pad] * length), 3]
    features = {
        "mm_hashes": {"image": [stored.mm_hash]},
        "mm_placeholders": {"image": [{"offset": 2, "length": length}]},
        "kwargs_data": {"image": [encode_ref(descriptor, stored.mm_hash)]},
    }
    return token_ids, features, stored.width, stored.height


def send_image(server: Server, data: bytes) -> None:
    token_ids, features, width, height = request_for(server, data)
    body = {"prompt_token_ids": token_ids, "features": features, "sampling": {"max_tokens": 1}}
    response = server.post("/v1/rawmm/generate", body)
    answer = assert_answered(response)
    expected = expected_outcome(server, width, height)
    assert (None if response.status_code == 200 else answer["error"]["reason"]) == expected, (width, height)


@pytest.mark.parametrize("name", sorted(ODD_IMAGES))
def test_named_odd_images_are_served_or_refused_with_a_reason(server: Server, name: str) -> None:
    mode, width, height, fmt, frames = ODD_IMAGES[name]
    send_image(server, encode(mode, width, height, fmt, seed=len(name), frames=frames))


sides = st.one_of(st.integers(1, 4), st.integers(1, 300), st.sampled_from([199, 200, 201, 1000]))


@FUZZ
@given(data=st.data())
def test_fuzzed_real_images_are_served_or_refused_with_a_reason(server: Server, data: st.DataObject) -> None:
    fmt = data.draw(st.sampled_from(sorted(FORMAT_MODES)))
    mode = data.draw(st.sampled_from(FORMAT_MODES[fmt]))
    width, height = data.draw(sides), data.draw(sides)
    if width * height > 4 * MAX_IMAGE_PIXELS:
        height = max(1, 4 * MAX_IMAGE_PIXELS // width)
    send_image(server, encode(mode, width, height, fmt, seed=data.draw(st.integers(0, 2**16))))


def test_a_truncated_png_is_a_decode_error(server: Server) -> None:
    whole = encode("RGB", 64, 48, "PNG", seed=3)
    token_ids, features, _, _ = request_for(server, whole[: len(whole) // 2])
    response = server.post("/v1/rawmm/generate", {"prompt_token_ids": token_ids, "features": features})
    assert assert_answered(response)["error"]["reason"] == "decode_error"


# --- hostile ref text ----------------------------------------------------------------------------------------

path_chars = st.characters(exclude_categories=())  # every code point, lone surrogates included
path_parts = st.one_of(
    st.text(path_chars, max_size=12),
    st.integers(200, 5000).map(lambda n: "a" * n),  # over NAME_MAX, or PATH_MAX with separators
    st.sampled_from(["..", ".", "", "%2e%2e", "%ED%A0%80", "%00", "%ff", "\ud800", "\udcff", "?q", "#f"]),
)


@st.composite
def hostile_uris(draw: st.DrawFn, root: str) -> str:
    """Mostly paths under the real root (where the file system gets asked), sometimes other schemes."""
    parts = draw(st.lists(path_parts, min_size=1, max_size=6))
    prefix = draw(
        st.one_of(st.just("file://"), st.sampled_from(["file://localhost", "file://host", "file:", ""]))
    )
    base = draw(st.one_of(st.just(root), st.sampled_from(["", "/etc", root + "/ab"])))
    return prefix + base + "/" + "/".join(parts)


def with_uri(server: Server, uri: str) -> bytes:
    """The base request with its first ref pointing at ``uri``. json.dumps writes what it cannot encode as
    ``\\uXXXX``, so a lone surrogate reaches the server as ``"\\ud800"``, exactly as a hostile client sends it."""
    token_ids, features = base_request(server)
    ref_body = json.loads(features["kwargs_data"]["image"][0].removeprefix("mmraw:"))
    features["kwargs_data"]["image"][0] = "mmraw:" + json.dumps({**ref_body, "raw_image_uri": uri})
    body = {"prompt_token_ids": token_ids, "features": features, "sampling": {"max_tokens": 1}}
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    "tail",
    [
        "ab/\ud800.png",  # a lone surrogate: was a UnicodeEncodeError in Path.resolve (500)
        "ab/" + "a" * 300 + ".png",  # a component over NAME_MAX: was ENAMETOOLONG from Path.exists (500)
        "ab/" * 1400 + "x.png",  # a path over PATH_MAX: likewise
    ],
)
def test_the_known_hostile_uris_are_malformed_refs(server: Server, tail: str) -> None:
    response = server.post("/v1/rawmm/generate", with_uri(server, f"file://{server.store.root}/{tail}"))
    assert assert_answered(response)["error"]["reason"] == "malformed_ref"


@FUZZ
@given(data=st.data())
def test_fuzzed_ref_text_is_never_a_server_error(server: Server, data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from(["uri", "field", "text"]))
    if kind == "uri":
        body = with_uri(server, data.draw(hostile_uris(str(server.store.root))))
    else:
        token_ids, features = base_request(server)
        ref_body = json.loads(features["kwargs_data"]["image"][0].removeprefix("mmraw:"))
        if kind == "field":
            ref_body[data.draw(st.sampled_from([*sorted(ref_body), "extra"]))] = data.draw(json_values)
            ref = "mmraw:" + json.dumps(ref_body)
        else:
            ref = data.draw(st.text(path_chars, max_size=200))
        features["kwargs_data"]["image"][0] = ref
        body = json.dumps(
            {"prompt_token_ids": token_ids, "features": features, "sampling": {"max_tokens": 1}}
        )
        body = body.encode()
    assert_answered(server.post("/v1/rawmm/generate", body))


# --- arbitrary body structure --------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)
# Token budgets that are either tiny or far too large, so a fuzzed body never runs a long generation.
max_tokens = st.one_of(st.integers(max_value=3), st.integers(min_value=5000), json_values)


def mutate(value: Any, data: st.DataObject) -> Any:
    """``value`` with one randomly chosen leaf (or subtree) replaced by arbitrary JSON."""
    if isinstance(value, dict) and value and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(sorted(value)))
        return {**value, key: mutate(value[key], data)}
    if isinstance(value, list) and value and data.draw(st.booleans()):
        index = data.draw(st.integers(0, len(value) - 1))
        return [*value[:index], mutate(value[index], data), *value[index + 1 :]]
    return data.draw(json_values)


_base: dict[str, tuple[list[int], dict[str, Any]]] = {}


def base_request(server: Server) -> tuple[list[int], dict[str, Any]]:
    """A valid two-image request (rendered once), as fresh copies to mutate."""
    if server.url not in _base:
        _base[server.url] = server.render([user(picture(70), "fuzz", picture(71, 40, 60))])
    token_ids, features = _base[server.url]
    return list(token_ids), json.loads(json.dumps(features))


@FUZZ
@given(data=st.data())
def test_a_fuzzed_generate_body_is_never_a_server_error(server: Server, data: st.DataObject) -> None:
    token_ids, features = base_request(server)
    kind = data.draw(st.sampled_from(["anything", "mutated features", "mutated body", "bytes"]))
    if kind == "anything":
        body: Any = data.draw(json_values)
    elif kind == "bytes":
        body = data.draw(st.binary(max_size=64))
    else:
        body = {
            "prompt_token_ids": token_ids,
            "features": mutate(features, data) if kind == "mutated features" else features,
            "sampling": data.draw(
                st.fixed_dictionaries({}, optional={"max_tokens": max_tokens, "seed": json_values})
            ),
        }
        if kind == "mutated body":
            body = mutate(body, data)
            if isinstance(body, dict) and isinstance(body.get("sampling"), dict):
                body["sampling"]["max_tokens"] = data.draw(max_tokens)
    assert_answered(server.post("/v1/rawmm/generate", body))


@FUZZ
@given(data=st.data())
def test_a_fuzzed_weights_request_is_refused_with_a_reason(server: Server, data: st.DataObject) -> None:
    printable = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=40)
    header = data.draw(
        st.one_of(st.none(), st.just(f"Bearer {WEIGHTS_TOKEN}"), printable, printable.map("Bearer ".__add__))
    )
    body = data.draw(
        st.one_of(
            json_values,
            st.fixed_dictionaries({"path": st.one_of(hostile_uris(str(server.weights_root)), json_values)}),
        )
    )
    headers = {"Authorization": header} if header is not None else None
    response = server.post("/v1/rawmm/weights", body, headers)
    assert_answered(response, allowed=(400, 403))  # never a 200: no fuzzed path is a checkpoint in the root
