import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rawmm.contract import InvalidImageRef, RawImageDescriptor, encode_ref, parse_ref
from rawmm.contract.refs import MAX_REF_CHARS

names = st.from_regex(r"[A-Za-z0-9_.-]{1,64}", fullmatch=True)
hashes = st.from_regex(r"[a-f0-9]{16,128}", fullmatch=True)
fingerprints = st.none() | st.from_regex(r"[A-Za-z0-9_.:-]{1,128}", fullmatch=True)
grids = st.lists(st.integers(1, 10_000), min_size=3, max_size=3)
uri_paths = st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=80)
descriptors = st.builds(
    RawImageDescriptor,
    family=names,
    modality=names,
    payload=st.dictionaries(
        st.sampled_from(["image_grid_thw", "grid_thws", "x"]), st.lists(grids, max_size=2)
    ),
    raw_image_uri=uri_paths.map(lambda p: "file:///" + p),
    fingerprint=fingerprints,
)


def _valid_ref() -> str:
    descriptor = RawImageDescriptor(
        family="qwen_vl",
        modality="image",
        payload={"image_grid_thw": [[1, 4, 6]]},
        raw_image_uri="file:///data/images/ab/" + "ab" * 32 + ".png",
        fingerprint="0123456789abcdef",
    )
    return encode_ref(descriptor, "ab" * 16)


@given(descriptor=descriptors, mm_hash=hashes)
@settings(max_examples=200, deadline=None)
def test_round_trip(descriptor: RawImageDescriptor, mm_hash: str) -> None:
    text = encode_ref(descriptor, mm_hash)
    ref = parse_ref(text)
    assert ref.canonical == text  # what engines key their cache on
    assert (ref.family, ref.modality, ref.mm_hash, ref.payload, ref.raw_image_uri, ref.fingerprint) == (
        descriptor.family,
        descriptor.modality,
        mm_hash,
        descriptor.payload,
        descriptor.raw_image_uri,
        descriptor.fingerprint,
    )


def test_canonical_is_one_text_whatever_spelling_arrived() -> None:
    text = _valid_ref()
    body = json.loads(text.removeprefix("mmraw:"))
    spelled_otherwise = "mmraw:" + json.dumps(dict(reversed(list(body.items()))), indent=1)
    assert spelled_otherwise != text
    assert parse_ref(spelled_otherwise).canonical == parse_ref(text).canonical == text


def test_wire_format_is_prefix_plus_compact_sorted_json_without_base64() -> None:
    text = _valid_ref()
    body = json.loads(text.removeprefix("mmraw:"))
    assert text == "mmraw:" + json.dumps(body, sort_keys=True, separators=(",", ":"))
    assert set(body) == {"family", "modality", "mm_hash", "payload", "raw_image_uri", "fingerprint"}


def test_ref_without_fingerprint_is_accepted_and_descriptor_restores_family_modality() -> None:
    kimi = RawImageDescriptor(
        "kimi_k25", "image", {"grid_thws": [[1, 2, 2]]}, "file:///x.png", None, "vision_chunk"
    )
    text = encode_ref(kimi, "0" * 32)
    assert "fingerprint" not in json.loads(text[6:])
    assert parse_ref(text).descriptor() == kimi
    assert parse_ref(text).descriptor().engine_modality == "vision_chunk"


@st.composite
def mutations(draw: st.DrawFn) -> str:
    text = _valid_ref()
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(text)))
        op = draw(st.sampled_from(["insert", "delete", "replace", "truncate"]))
        ch = draw(st.characters())
        if op == "insert":
            text = text[:i] + ch + text[i:]
        elif op == "delete":
            text = text[:i] + text[i + 1 :]
        elif op == "replace":
            text = text[:i] + ch + text[i + 1 :]
        else:
            text = text[:i]
    return text


@given(text=mutations())
@settings(max_examples=500, deadline=None)
def test_mutated_refs_parse_or_raise_malformed_ref_only(text: str) -> None:
    try:
        ref = parse_ref(text)
    except InvalidImageRef as exc:
        assert exc.reason == "malformed_ref"
    else:  # a mutation that stays well formed must still satisfy the format
        assert parse_ref(encode_ref(ref.descriptor(), ref.mm_hash)) == ref


@given(value=st.text(max_size=200) | st.binary(max_size=50) | st.integers() | st.none() | st.lists(st.text()))
@settings(max_examples=200, deadline=None)
def test_arbitrary_input_is_malformed_ref(value: object) -> None:
    if isinstance(value, str):
        value = "mmraw:" + value
    with pytest.raises(InvalidImageRef) as info:
        parse_ref(value)
    assert info.value.reason == "malformed_ref"


def _body(**changes: object) -> dict:
    body = json.loads(_valid_ref()[6:])
    body.update(changes)
    return {k: v for k, v in body.items() if v is not ...}


@pytest.mark.parametrize(
    "text",
    [
        "mmraw" + _valid_ref()[5:].replace(":", "", 1),
        "MMRAW:" + _valid_ref()[6:],
        "mmraw:eyJmYW1pbHkiOiJxd2VuX3ZsIn0=",  # the old base64-wrapped form
        "mmraw:[]",
        "mmraw:" + json.dumps(_body(family=...)),
        "mmraw:" + json.dumps(_body(extra=1)),
        "mmraw:" + json.dumps(_body(family="qwen/vl")),
        "mmraw:" + json.dumps(_body(family="")),
        "mmraw:" + json.dumps(_body(modality=3)),
        "mmraw:" + json.dumps(_body(mm_hash="AB" * 16)),
        "mmraw:" + json.dumps(_body(mm_hash="ab" * 7)),
        "mmraw:" + json.dumps(_body(mm_hash="ab" * 16 + "\n")),
        "mmraw:" + json.dumps(_body(raw_image_uri="http://host/x.png")),
        "mmraw:" + json.dumps(_body(raw_image_uri="file:///x\n.png")),
        "mmraw:" + json.dumps(_body(raw_image_uri="file:///x.png\t")),  # urlsplit would drop the tab
        "mmraw:" + json.dumps(_body(raw_image_uri="file:///x\x7f.png")),
        "mmraw:" + json.dumps(_body(payload=[1, 2])),
        "mmraw:" + json.dumps(_body(payload={"g": [[[[[[[[[[[1]]]]]]]]]]]})),
        "mmraw:" + json.dumps(_body(fingerprint="not a fingerprint!")),
        "mmraw:" + json.dumps(_body(fingerprint=7)),
        "mmraw:" + json.dumps(_body(payload={"x": float("nan")})),
        "mmraw:" + json.dumps(_body(payload={"x": 1e999})).replace("Infinity", "1e999"),
        _valid_ref()[:-1] + ',"family":"kimi_k25"}',  # duplicate key
        "mmraw:" + "[" * 5000 + "]" * 5000,
        "mmraw:" + json.dumps(_body(payload={"x": "a" * MAX_REF_CHARS})),
        "mmraw:" + json.dumps(_body(raw_image_uri="file:///\ud800.png"), ensure_ascii=False),
        "mmraw:" + "9" * 5000,
    ],
)
def test_malformed_refs(text: str) -> None:
    with pytest.raises(InvalidImageRef) as info:
        parse_ref(text)
    assert info.value.reason == "malformed_ref"


def test_descriptor_dict_round_trip_and_strictness() -> None:
    descriptor = parse_ref(_valid_ref()).descriptor()
    assert RawImageDescriptor.from_dict(json.loads(json.dumps(descriptor.to_dict()))) == descriptor
    for broken in (
        {**descriptor.to_dict(), "surprise": 1},
        {k: v for k, v in descriptor.to_dict().items() if k != "payload"},
        {**descriptor.to_dict(), "vllm_modality": "bad modality"},
        ["not", "a", "dict"],
    ):
        with pytest.raises(InvalidImageRef) as info:
            RawImageDescriptor.from_dict(broken)
        assert info.value.reason == "malformed_ref"


def test_encode_refuses_what_parse_would_refuse() -> None:
    good = parse_ref(_valid_ref()).descriptor()
    with pytest.raises(InvalidImageRef):
        encode_ref(good, "XYZ")
    with pytest.raises(InvalidImageRef):
        encode_ref(RawImageDescriptor("qwen_vl", "image", {}, "s3://bucket/x.png"), "ab" * 16)


def test_a_lone_surrogate_escape_in_the_uri_is_malformed() -> None:
    # Valid JSON whose decoded string cannot be encoded: it must stop at the parser, not reach the file system.
    text = _valid_ref().replace(".png", "\\ud800.png")
    with pytest.raises(InvalidImageRef) as info:
        parse_ref(text)
    assert info.value.reason == "malformed_ref" and "surrogate" in info.value.message
