import msgspec
import pytest

from rawmm.contract import RawImageDescriptor, RenderedImage, RenderedPrompt
from rawmm.rl.samples import (
    MMRefs,
    RolloutBatch,
    Sample,
    SampleError,
    build_mm_refs,
    completion_sample,
    decode_batch,
    encode_batch,
    extend_sample,
    truncate_sample,
    validate_image_spans,
)


def descriptor(name: str, family: str = "qwen_vl") -> dict:
    return {
        "family": family,
        "modality": "image",
        "payload": {"image_grid_thw": [[1, 2, 4]]},
        "raw_image_uri": f"file:///offload/{name}.png",
    }


def image_sample(spans: list[tuple[int, int]], n_tokens: int, sample_id: str = "s") -> Sample:
    """A sample whose mm_token_type_ids are 1 exactly on `spans`, with distinct per-token values."""
    types = [0] * n_tokens
    for offset, length in spans:
        types[offset : offset + length] = [1] * length
    refs = build_mm_refs(
        [descriptor(f"{sample_id}-{i}") for i in range(len(spans))],
        [f"{i:032x}" for i in range(len(spans))],
        [{"offset": o, "length": n} for o, n in spans],
    )
    return Sample(
        token_ids=list(range(100, 100 + n_tokens)),
        mm_token_type_ids=types,
        loss_mask=[i >= n_tokens // 2 for i in range(n_tokens)],
        advantages=[float(i) for i in range(n_tokens)],
        logprobs=[-float(i) / 10 for i in range(n_tokens)],
        mm_refs=refs,
        reward=1.5,
        sample_id=sample_id,
    )


def test_build_mm_refs_keeps_order_and_descriptors():
    refs = build_mm_refs(
        [descriptor("a"), descriptor("b")],
        ["a" * 32, "b" * 32],
        [{"offset": 2, "length": 3}, {"offset": 7, "length": 2}],
    )
    assert [r.uri for r in refs] == ["file:///offload/a.png", "file:///offload/b.png"]
    assert [(r.offset, r.length, r.mm_hash[0]) for r in refs] == [(2, 3, "a"), (7, 2, "b")]
    assert refs.family == "qwen_vl"


def test_build_mm_refs_accepts_objects_with_to_dict():
    class Descriptor:
        def to_dict(self) -> dict:
            return descriptor("obj")

    refs = build_mm_refs([Descriptor()], ["c" * 32], [{"offset": 0, "length": 1}])
    assert refs[0].descriptor == descriptor("obj")


@pytest.mark.parametrize(
    ("descriptors", "hashes", "placeholders", "message"),
    [
        ([descriptor("a")], ["a" * 32, "b" * 32], [{"offset": 0, "length": 1}], "counts disagree"),
        (
            [{**descriptor("a"), "raw_image_uri": "http://x/a.png"}],
            ["a" * 32],
            [{"offset": 0, "length": 1}],
            "file://",
        ),
        ([descriptor("a")], ["a" * 32], [{"offset": -1, "length": 1}], "offset=-1"),
        ([descriptor("a")], ["a" * 32], [{"offset": 0, "length": 0}], "length=0"),
        (
            [descriptor("a"), descriptor("b")],
            ["a" * 32, "b" * 32],
            [{"offset": 0, "length": 4}, {"offset": 3, "length": 2}],
            "overlaps",
        ),
        (
            [descriptor("a"), descriptor("b")],
            ["a" * 32, "b" * 32],
            [{"offset": 5, "length": 1}, {"offset": 1, "length": 2}],
            "precedes",
        ),
    ],
)
def test_build_mm_refs_rejects_bad_input(descriptors, hashes, placeholders, message):
    with pytest.raises(SampleError, match=message):
        build_mm_refs(descriptors, hashes, placeholders)


def test_build_mm_refs_error_names_the_image():
    with pytest.raises(SampleError, match=r"image 1 \(file:///offload/b.png\)"):
        build_mm_refs(
            [descriptor("a"), descriptor("b")],
            ["a" * 32, "b" * 32],
            [{"offset": 0, "length": 2}, {"offset": 1, "length": 1}],
        )


def test_validate_image_spans_accepts_aligned_spans():
    sample = image_sample([(1, 3), (6, 2)], 10)
    validate_image_spans(sample.mm_refs, sample.mm_token_type_ids)


@pytest.mark.parametrize(
    ("types", "message"),
    [
        ([0, 0, 1, 1, 1, 0, 1, 1, 0, 0], "covers 1 non-image tokens, first at 1"),  # span starts one early
        ([0, 1, 1, 0, 0, 0, 1, 1, 0, 0], "covers 1 non-image tokens, first at 3"),  # span too long
        (
            [0, 1, 1, 1, 1, 0, 1, 1, 0, 0],
            "6 image-typed tokens but the 2 image spans cover 5",
        ),  # image tokens outside any span
    ],
)
def test_validate_image_spans_detects_drift(types, message):
    sample = image_sample([(1, 3), (6, 2)], 10)
    with pytest.raises(SampleError, match=f"placeholder offsets drifted.*{message}"):
        validate_image_spans(sample.mm_refs, types)


def test_validate_image_spans_rejects_span_past_the_end():
    refs = build_mm_refs([descriptor("a")], ["a" * 32], [{"offset": 3, "length": 4}])
    with pytest.raises(SampleError, match="outside the 5 tokens"):
        validate_image_spans(refs, [0, 0, 0, 1, 1])


def test_sample_rejects_misaligned_arrays_and_mixed_families():
    with pytest.raises(SampleError, match="loss_mask has 1 entries, token_ids has 2"):
        Sample(
            token_ids=[1, 2], mm_token_type_ids=[0, 0], loss_mask=[True], advantages=[0, 0], logprobs=[0, 0]
        )
    refs = MMRefs(
        images=(
            build_mm_refs([descriptor("a")], ["a" * 32], [{"offset": 0, "length": 1}])[0],
            build_mm_refs([descriptor("b", "kimi_k25")], ["b" * 32], [{"offset": 1, "length": 1}])[0],
        )
    )
    with pytest.raises(SampleError, match="mixes image families"):
        Sample(
            token_ids=[1, 2],
            mm_token_type_ids=[1, 1],
            loss_mask=[0, 0],
            advantages=[0, 0],
            logprobs=[0, 0],
            mm_refs=refs,
        )


def assert_prefix(truncated: Sample, original: Sample, n: int) -> None:
    assert len(truncated) == n
    for field in ("token_ids", "mm_token_type_ids", "loss_mask", "advantages", "logprobs"):
        assert getattr(truncated, field) == getattr(original, field)[:n], field
    assert (truncated.reward, truncated.sample_id) == (original.reward, original.sample_id)


def test_truncate_before_an_image_drops_it_whole():
    sample = image_sample([(2, 3), (8, 4)], 16)
    cut = truncate_sample(sample, 7)
    assert_prefix(cut, sample, 7)
    assert [r.offset for r in cut.mm_refs] == [2]
    validate_image_spans(cut.mm_refs, cut.mm_token_type_ids)


def test_truncate_inside_an_image_cuts_at_its_start():
    sample = image_sample([(2, 3), (8, 4)], 16)
    cut = truncate_sample(sample, 10)
    assert_prefix(cut, sample, 8)
    assert [r.offset for r in cut.mm_refs] == [2]
    validate_image_spans(cut.mm_refs, cut.mm_token_type_ids)


def test_truncate_exactly_at_an_image_end_keeps_it():
    sample = image_sample([(2, 3), (8, 4)], 16)
    cut = truncate_sample(sample, 12)
    assert_prefix(cut, sample, 12)
    assert [r.offset for r in cut.mm_refs] == [2, 8]
    validate_image_spans(cut.mm_refs, cut.mm_token_type_ids)


def test_truncate_inside_the_first_image_leaves_text_only():
    sample = image_sample([(2, 3)], 8)
    cut = truncate_sample(sample, 3)
    assert_prefix(cut, sample, 2)
    assert len(cut.mm_refs) == 0 and cut.family is None


def test_truncate_short_sample_is_unchanged():
    sample = image_sample([(2, 3)], 8)
    assert truncate_sample(sample, 8) is sample
    with pytest.raises(SampleError, match="positive"):
        truncate_sample(sample, 0)


def test_batch_round_trips():
    batch = RolloutBatch(
        step=3,
        samples=[image_sample([(1, 3)], 8, "g0-r0"), image_sample([], 5, "g0-r1")],
        metadata={"weights_version": 2},
    )
    decoded = decode_batch(encode_batch(batch))
    assert decoded == batch
    assert decoded.samples[0].mm_refs[0].uri == "file:///offload/g0-r0-0.png"


def test_decode_batch_rejects_truncated_and_invalid_payloads():
    data = encode_batch(RolloutBatch(step=1, samples=[image_sample([(1, 3)], 8)]))
    with pytest.raises(SampleError, match="unreadable"):
        decode_batch(data[:-5])
    bad = msgspec.msgpack.encode(
        {
            "step": 1,
            "samples": [
                {"token_ids": [1], "mm_token_type_ids": [], "loss_mask": [], "advantages": [], "logprobs": []}
            ],
        }
    )
    with pytest.raises(SampleError, match=r"invalid rollout batch.*mm_token_type_ids has 0 entries"):
        decode_batch(bad)


def prompt(tokens: list[int], images: list[tuple[str, int, int]]) -> RenderedPrompt:
    """A rendered prompt whose image `(hash char, offset, length)` spans are image-typed tokens."""
    types = [0] * len(tokens)
    for _, offset, length in images:
        types[offset : offset + length] = [1] * length
    rendered = [
        RenderedImage(RawImageDescriptor.from_dict(descriptor(h)), h * 32, offset, length)
        for h, offset, length in images
    ]
    return RenderedPrompt(token_ids=tokens, mm_token_type_ids=types, images=rendered)


def test_completion_sample_trains_the_completion_only():
    sample = completion_sample(
        prompt([1, 9, 9, 2], [("a", 1, 2)]),
        [5, 6],
        [-0.5, -0.25],
        advantage=2.0,
        reward=1.0,
        sample_id="r-t0",
    )
    assert sample.token_ids == [1, 9, 9, 2, 5, 6]
    assert sample.mm_token_type_ids == [0, 1, 1, 0, 0, 0]
    assert sample.loss_mask == [False] * 4 + [True] * 2
    assert sample.advantages == [0.0] * 4 + [2.0] * 2
    assert sample.logprobs == [0.0] * 4 + [-0.5, -0.25]
    assert [(i.mm_hash[0], i.offset, i.length) for i in sample.mm_refs] == [("a", 1, 2)]
    assert (sample.reward, sample.sample_id) == (1.0, "r-t0")
    with pytest.raises(SampleError, match="2 completion tokens but 1 logprobs"):
        completion_sample(prompt([1], []), [5, 6], [-0.5], advantage=1.0)


def test_extend_sample_keeps_earlier_turns_and_trains_the_new_completion():
    first = completion_sample(prompt([1, 9, 9, 2], [("a", 1, 2)]), [5, 6], [-0.5, -0.25], advantage=2.0)
    later = prompt([1, 9, 9, 2, 5, 6, 3, 8, 8, 4], [("a", 1, 2), ("b", 7, 2)])
    merged = extend_sample(first, later, [7], [-1.0], advantage=2.0)
    assert merged is not None
    assert merged.token_ids == [1, 9, 9, 2, 5, 6, 3, 8, 8, 4, 7]
    assert merged.loss_mask == [False] * 4 + [True] * 2 + [False] * 4 + [True]
    assert merged.logprobs == [0.0] * 4 + [-0.5, -0.25] + [0.0] * 4 + [-1.0]
    assert merged.advantages == [0.0] * 4 + [2.0] * 2 + [0.0] * 4 + [2.0]
    assert [(i.mm_hash[0], i.offset) for i in merged.mm_refs] == [("a", 1), ("b", 7)]


@pytest.mark.parametrize(
    "later",
    [
        prompt([1, 9, 9, 2, 5, 7, 3], [("a", 1, 2)]),  # the reply re-rendered as other tokens
        prompt([1, 9, 9, 2, 5], [("a", 1, 2)]),  # shorter than the sample
        prompt([1, 9, 9, 2, 5, 6, 3], [("b", 1, 2)]),  # same placeholder tokens, another image
        prompt([1, 9, 9, 2, 5, 6, 3], []),  # the image is gone: its tokens are typed as text
    ],
    ids=["rerendered", "shorter", "other-image", "image-dropped"],
)
def test_a_prompt_that_does_not_start_with_the_sample_forks(later):
    first = completion_sample(prompt([1, 9, 9, 2], [("a", 1, 2)]), [5, 6], [-0.5, -0.25], advantage=2.0)
    assert extend_sample(first, later, [7], [-1.0], advantage=2.0) is None
