"""Training samples that carry raw image refs instead of pixels, and the batch format on the shared volume.

A `Sample` is one rollout branch as the trainer sees it: per-token arrays (token ids, mm token types,
loss mask, advantages, sampled logprobs) plus `MMRefs`, the ordered images of the sample, each an
`MMImageRef` = descriptor + content hash + placeholder span. Everything is a msgspec Struct, so a
step's `RolloutBatch` serializes to compact msgpack (`encode_batch` / `decode_batch`).

`completion_sample` is the one constructor of a sample from a rendered prompt and the tokens sampled
after it; `extend_sample` appends a later turn to a sample when the turn's prompt starts with exactly
that sample's tokens and images (one sample per prefix-consistent branch, docs/architecture.md §5).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from rawmm.contract import RenderedPrompt


class SampleError(ValueError):
    """A sample, its image refs or a rollout batch is inconsistent."""


class MMImageRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One image of a sample: where its bytes are, what they hash to, and its placeholder span.

    `descriptor` is the JSON form of a `rawmm.contract.RawImageDescriptor` (family, modality,
    payload, raw_image_uri[, fingerprint, vllm_modality]); `offset`/`length` index the sample's
    token stream (or, after packing, the packed stream).
    """

    descriptor: dict[str, Any]
    mm_hash: str
    offset: int
    length: int

    @property
    def uri(self) -> str:
        return self.descriptor["raw_image_uri"]

    @property
    def family(self) -> str:
        return self.descriptor["family"]

    @property
    def end(self) -> int:
        return self.offset + self.length

    def shifted(self, by: int) -> MMImageRef:
        return msgspec.structs.replace(self, offset=self.offset + by)


class MMRefs(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The ordered images of one sample (spans sorted by offset, non-overlapping)."""

    images: tuple[MMImageRef, ...] = ()

    def __len__(self) -> int:
        return len(self.images)

    def __iter__(self) -> Iterator[MMImageRef]:
        return iter(self.images)

    def __getitem__(self, index: int) -> MMImageRef:
        return self.images[index]

    @property
    def family(self) -> str | None:
        """The family of the sample's images; None for a text-only sample."""
        return self.images[0].family if self.images else None


class Sample(msgspec.Struct, forbid_unknown_fields=True):
    """One rollout ready for training. All per-token lists have the same length.

    `logprobs` are the logprobs the inference engine sampled each token with (0.0 where nothing was
    sampled); the loss uses them as the old policy in the importance ratio. `advantages` are per token
    (a group-normalized advantage is simply repeated over the sample's completion tokens).
    """

    token_ids: list[int]
    mm_token_type_ids: list[int]
    loss_mask: list[bool]
    advantages: list[float]
    logprobs: list[float]
    mm_refs: MMRefs = MMRefs()
    reward: float = 0.0
    sample_id: str = ""

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        for name in ("mm_token_type_ids", "loss_mask", "advantages", "logprobs"):
            if len(getattr(self, name)) != n:
                raise SampleError(
                    f"sample {self.sample_id!r}: {name} has {len(getattr(self, name))} entries, "
                    f"token_ids has {n}"
                )
        families = {image.family for image in self.mm_refs}
        if len(families) > 1:
            raise SampleError(f"sample {self.sample_id!r} mixes image families {sorted(families)}")
        for image in self.mm_refs:
            if image.end > n:
                raise SampleError(
                    f"sample {self.sample_id!r}: image {image.uri} span [{image.offset}, {image.end}) "
                    f"ends past the sample's {n} tokens"
                )

    @property
    def family(self) -> str | None:
        return self.mm_refs.family

    def __len__(self) -> int:
        return len(self.token_ids)


class RolloutBatch(msgspec.Struct, forbid_unknown_fields=True):
    """One training step's samples as written to `<shared_dir>/rollouts/step_<N>.msgpack`.

    `metadata` is free-form and JSON-safe (e.g. the weights version the rollouts were sampled with,
    timings); the trainer does not interpret it.
    """

    step: int
    samples: list[Sample]
    metadata: dict[str, Any] = {}


_encoder = msgspec.msgpack.Encoder()
_batch_decoder = msgspec.msgpack.Decoder(RolloutBatch)


def encode_batch(batch: RolloutBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(data: bytes) -> RolloutBatch:
    """Decode a batch; a truncated, foreign or malformed payload is a `SampleError`."""
    try:
        return _batch_decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise SampleError(f"invalid rollout batch: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise SampleError(f"unreadable rollout batch: {exc}") from exc


def _descriptor_dict(descriptor: Any) -> dict[str, Any]:
    if isinstance(descriptor, Mapping):
        return dict(descriptor)
    return descriptor.to_dict()


def build_mm_refs(
    descriptors: Sequence[Any],
    mm_hashes: Sequence[str],
    placeholders: Sequence[Mapping[str, int]],
) -> MMRefs:
    """Zip descriptors, hashes and placeholders (`{"offset", "length"}`, the request-features form)
    into `MMRefs`, enforcing equal counts, `file://` URIs, positive spans in sorted, non-overlapping
    order. `descriptors` are `RawImageDescriptor`s or their `to_dict()` form."""
    if not len(descriptors) == len(mm_hashes) == len(placeholders):
        raise SampleError(
            f"image counts disagree: {len(descriptors)} descriptors, {len(mm_hashes)} hashes, "
            f"{len(placeholders)} placeholders"
        )
    images: list[MMImageRef] = []
    for index, (descriptor, mm_hash, placeholder) in enumerate(
        zip(descriptors, mm_hashes, placeholders, strict=True)
    ):
        data = _descriptor_dict(descriptor)
        uri = data.get("raw_image_uri")
        name = f"image {index} ({uri})"
        if not isinstance(uri, str) or not uri.startswith("file://"):
            raise SampleError(f"{name}: raw_image_uri must be a file:// URI")
        if not isinstance(data.get("family"), str):
            raise SampleError(f"{name}: descriptor has no family")
        if not isinstance(mm_hash, str) or not mm_hash:
            raise SampleError(f"{name}: mm_hash must be a non-empty string")
        offset, length = int(placeholder["offset"]), int(placeholder["length"])
        if offset < 0 or length <= 0:
            raise SampleError(f"{name}: placeholder offset={offset} length={length} must be >= 0 and > 0")
        if images and offset < images[-1].end:
            raise SampleError(
                f"{name}: placeholder at {offset} overlaps or precedes the previous image's span "
                f"[{images[-1].offset}, {images[-1].end})"
            )
        images.append(MMImageRef(descriptor=data, mm_hash=mm_hash, offset=offset, length=length))
    return MMRefs(images=tuple(images))


def validate_image_spans(mm_refs: MMRefs, mm_token_type_ids: Sequence[int]) -> None:
    """Every placeholder span lies entirely on image-typed tokens (type 1), and every image-typed token
    belongs to a span. Anything else means offsets drifted upstream of the trainer: fail loudly."""
    n = len(mm_token_type_ids)
    covered = 0
    for index, image in enumerate(mm_refs):
        if image.offset < 0 or image.end > n:
            raise SampleError(
                f"placeholder offsets drifted: image {index} ({image.uri}) span [{image.offset}, "
                f"{image.end}) is outside the {n} tokens"
            )
        span_types = mm_token_type_ids[image.offset : image.end]
        bad = [image.offset + i for i, kind in enumerate(span_types) if kind != 1]
        if bad:
            raise SampleError(
                f"placeholder offsets drifted: image {index} ({image.uri}) span [{image.offset}, "
                f"{image.end}) covers {len(bad)} non-image tokens, first at {bad[0]}"
            )
        covered += image.length
    image_tokens = sum(1 for kind in mm_token_type_ids if kind == 1)
    if image_tokens != covered:
        raise SampleError(
            f"placeholder offsets drifted: {image_tokens} image-typed tokens but the "
            f"{len(mm_refs)} image spans cover {covered}"
        )


def truncate_sample(sample: Sample, seq_len: int) -> Sample:
    """Cut `sample` to at most `seq_len` tokens, keeping only images that fit whole.

    The cut moves back to the start of the first image whose placeholder would not fit, so no
    placeholder is ever split; that image and all later ones are dropped.
    """
    if seq_len <= 0:
        raise SampleError(f"seq_len must be positive, got {seq_len}")
    if len(sample) <= seq_len:
        return sample
    cut = seq_len
    kept: list[MMImageRef] = []
    for image in sample.mm_refs:
        if image.end > cut:
            cut = min(cut, image.offset)
            break
        kept.append(image)
    return Sample(
        token_ids=sample.token_ids[:cut],
        mm_token_type_ids=sample.mm_token_type_ids[:cut],
        loss_mask=sample.loss_mask[:cut],
        advantages=sample.advantages[:cut],
        logprobs=sample.logprobs[:cut],
        mm_refs=MMRefs(images=tuple(kept)),
        reward=sample.reward,
        sample_id=sample.sample_id,
    )


def prompt_mm_refs(prompt: RenderedPrompt) -> MMRefs:
    """The `MMRefs` of a rendered prompt's images, checked to lie on its image-typed tokens."""
    mm_refs = build_mm_refs(
        [image.descriptor for image in prompt.images],
        [image.mm_hash for image in prompt.images],
        [{"offset": image.offset, "length": image.length} for image in prompt.images],
    )
    validate_image_spans(mm_refs, prompt.mm_token_type_ids)
    return mm_refs


def completion_sample(
    prompt: RenderedPrompt,
    completion_ids: Sequence[int],
    completion_logprobs: Sequence[float],
    *,
    advantage: float,
    reward: float = 0.0,
    sample_id: str = "",
) -> Sample:
    """`prompt` followed by the tokens sampled after it: loss, advantage and logprobs on those only."""
    empty = Sample(token_ids=[], mm_token_type_ids=[], loss_mask=[], advantages=[], logprobs=[])
    sample = extend_sample(empty, prompt, completion_ids, completion_logprobs, advantage=advantage)
    assert sample is not None  # every prompt extends the empty sample
    return msgspec.structs.replace(sample, reward=reward, sample_id=sample_id)


def extends(sample: Sample, prompt: RenderedPrompt) -> bool:
    """Whether `prompt` starts with exactly `sample`'s tokens and images: then every token of `sample`
    has, inside `prompt`, the very context it had in `sample` (causal attention sees only the prefix)."""
    n = len(sample)
    if len(prompt.token_ids) < n or prompt.token_ids[:n] != sample.token_ids:
        return False
    if prompt.mm_token_type_ids[:n] != sample.mm_token_type_ids:
        return False
    earlier = [(image.mm_hash, image.offset, image.length) for image in sample.mm_refs]
    first = [(image.mm_hash, image.offset, image.length) for image in prompt.images[: len(earlier)]]
    # An image of the prompt that starts inside the sample would be one the sample's tokens did not see.
    later_inside = any(image.offset < n for image in prompt.images[len(earlier) :])
    return first == earlier and not later_inside


def extend_sample(
    sample: Sample,
    prompt: RenderedPrompt,
    completion_ids: Sequence[int],
    completion_logprobs: Sequence[float],
    *,
    advantage: float,
) -> Sample | None:
    """`sample` continued by `prompt`'s new tokens and the completion sampled after it, or None when
    `prompt` does not extend `sample` (the caller starts a new branch). The earlier tokens keep their
    loss mask, advantages and logprobs; the prompt's new tokens carry no loss."""
    if len(completion_ids) != len(completion_logprobs):
        raise SampleError(
            f"sample {sample.sample_id!r}: {len(completion_ids)} completion tokens but "
            f"{len(completion_logprobs)} logprobs"
        )
    if not extends(sample, prompt):
        return None
    new, c = len(prompt.token_ids) - len(sample), len(completion_ids)
    return Sample(
        token_ids=[*prompt.token_ids, *completion_ids],
        mm_token_type_ids=[*prompt.mm_token_type_ids, *[0] * c],
        mm_refs=prompt_mm_refs(prompt),
        loss_mask=[*sample.loss_mask, *[False] * new, *[True] * c],
        advantages=[*sample.advantages, *[0.0] * new, *[advantage] * c],
        logprobs=[*sample.logprobs, *[0.0] * new, *completion_logprobs],
        reward=sample.reward,
        sample_id=sample.sample_id,
    )
