"""RawImageMaterializer: per-step dedupe, packed image order, the missing-image policies, and its uint8
pixels normalized on use exactly as the processor normalizes them."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from PIL import Image
from rollout_kit import batch_loss
from transformers import AutoTokenizer

from rawmm.contract import InvalidImageRef, RawImageDescriptor, render_chat
from rawmm.materialize import get_adapter, load_processor
from rawmm.materialize.normalize import PixelNormalizer
from rawmm.rl.samples import Sample, build_mm_refs
from rawmm.rl.trainer.forward import forward_logprobs, sample_starts
from rawmm.rl.trainer.materializer import MaterializedMicroBatch, MissingImageError, RawImageMaterializer
from rawmm.rl.trainer.packing import PackedMicroBatch, concat_samples


def random_image(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


class SampleMaker:
    """Renders chats with the contract (offloading their images) into training samples."""

    def __init__(self, model_path, store) -> None:
        self.loaded = load_processor(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.store = store

    def __call__(self, images: list[Image.Image], sample_id: str, advantage: float = 1.0) -> Sample:
        messages = [
            {
                "role": "user",
                "content": [
                    *({"type": "image", "image": im} for im in images),
                    {"type": "text", "text": "what?"},
                ],
            }
        ]
        prompt = render_chat(
            messages,
            tokenizer=self.tokenizer,
            family=self.loaded.family,
            config=self.loaded.config,
            store=self.store,
            backend=self.loaded.backend,
        )
        completion = self.tokenizer.encode(" a red circle")
        n, c = len(prompt.token_ids), len(completion)
        return Sample(
            token_ids=[*prompt.token_ids, *completion],
            mm_token_type_ids=[*prompt.mm_token_type_ids, *[0] * c],
            loss_mask=[False] * n + [True] * c,
            advantages=[0.0] * n + [advantage] * c,
            logprobs=[0.0] * n + [-2.0] * c,
            mm_refs=build_mm_refs(
                [i.descriptor for i in prompt.images],
                [i.mm_hash for i in prompt.images],
                [{"offset": i.offset, "length": i.length} for i in prompt.images],
            ),
            reward=1.0,
            sample_id=sample_id,
        )

    def materializer(self, policy: str = "error", dedupe: bool = True) -> RawImageMaterializer:
        return RawImageMaterializer(
            self.loaded, roots=[self.store.root], missing_image_policy=policy, dedupe=dedupe
        )

    def model_inputs(self, out: MaterializedMicroBatch) -> dict[str, torch.Tensor]:
        """What the forward pass gives the model: the held uint8 pixels, normalized."""
        return PixelNormalizer(self.loaded).inputs(out.mm_kwargs())

    def reference_inputs(self, images: list[Image.Image]) -> dict[str, torch.Tensor]:
        """What the processor itself makes of `images`, in order."""
        out = self.loaded.processor(images=images, return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


@pytest.fixture
def make(tiny_qwen2_vl, offload_store) -> SampleMaker:
    return SampleMaker(tiny_qwen2_vl, offload_store)


def delete_image(make: SampleMaker, sample: Sample, index: int = 0) -> str:
    uri = sample.mm_refs[index].uri
    make.store.resolve(uri).unlink()
    return uri


def test_kwargs_follow_packed_image_order(make):
    prompt_image, zoom, other = random_image(90, 60, 0), random_image(64, 100, 1), random_image(120, 40, 2)
    batch = concat_samples([make([prompt_image, zoom], "a"), make([], "text"), make([other], "b")])
    got = make.materializer().materialize(batch)
    want = make.reference_inputs([prompt_image, zoom, other])
    assert got.mm_kwargs()["pixel_values"].dtype == torch.uint8  # held as uint8: a quarter of float32
    assert got.mm_kwargs()["pixel_values"].nbytes * 4 == want["pixel_values"].nbytes
    normalized = make.model_inputs(got)
    assert normalized.keys() == want.keys()
    for key in want:  # bit-exact: the table is built by the processor's own rescale/normalize ops
        torch.testing.assert_close(normalized[key], want[key], rtol=0, atol=0)
    assert got.missing == () and got.batch is batch


def test_text_only_micro_batch_has_no_image_inputs(make):
    assert make.materializer().materialize(concat_samples([make([], "t")])).mm_kwargs() == {}


def test_dedupe_materializes_each_image_once_per_step(make):
    shared, turn2, turn3 = random_image(90, 60, 0), random_image(64, 64, 1), random_image(80, 50, 2)
    # A group's prompt image in every sample, earlier turns repeated in later turns' samples.
    first = concat_samples([make([shared], "r0-t0"), make([shared, turn2], "r0-t1")])
    second = concat_samples([make([shared, turn2, turn3], "r0-t2"), make([shared], "r1-t0")])
    materializer = make.materializer()
    materializer.begin_step(1)
    outputs = [materializer.materialize(first), materializer.materialize(second)]
    assert (materializer.stats.images, materializer.stats.materialized) == (7, 3)
    want = make.reference_inputs([shared, shared, turn2, shared, turn2, turn3, shared])
    got = torch.cat([make.model_inputs(o)["pixel_values"] for o in outputs])
    torch.testing.assert_close(got, want["pixel_values"], rtol=0, atol=0)
    # The step holds each unique image once, as uint8.
    unique = make.reference_inputs([shared, turn2, turn3])
    assert (
        materializer.stats.held_bytes == unique["pixel_values"].nbytes // 4 + unique["image_grid_thw"].nbytes
    )

    materializer.begin_step(2)  # dedupe is per step: a new step materializes again
    materializer.materialize(first)
    assert (materializer.stats.images, materializer.stats.materialized) == (3, 2)

    undeduped = make.materializer(dedupe=False)
    undeduped.begin_step(1)
    undeduped.materialize(first)
    undeduped.materialize(second)
    assert (undeduped.stats.images, undeduped.stats.materialized) == (7, 7)


def test_missing_image_under_error_names_step_sample_and_uri(make):
    ok, broken = make([random_image(60, 60, 0)], "g0-r0"), make([random_image(70, 50, 1)], "g0-r1")
    uri = delete_image(make, broken)
    materializer = make.materializer("error")
    materializer.begin_step(7)
    with pytest.raises(MissingImageError) as caught:
        materializer.materialize(concat_samples([ok, broken]))
    message = str(caught.value)
    assert "step 7" in message and "'g0-r1'" in message and uri in message and "missing_file" in message
    assert "g0-r0" not in message


def test_zero_loss_zeroes_only_the_affected_sample(make):
    before, broken, after = (make([random_image(60 + 8 * i, 60, i)], f"s{i}") for i in range(3))
    delete_image(make, broken)
    materializer = make.materializer("zero_loss")
    materializer.begin_step(3)
    packed = concat_samples([before, broken, after])
    out = materializer.materialize(packed)

    assert [m.sample_id for m in out.missing] == ["s1"] and out.missing[0].reason == "missing_file"
    assert materializer.stats.missing == 1
    start, end = packed.starts[1], packed.starts[1] + packed.seq_lens[1]
    assert not any(out.batch.loss_mask[start:end]) and not any(out.batch.advantages[start:end])
    for lo, hi in ((0, start), (end, len(packed))):
        assert out.batch.loss_mask[lo:hi] == packed.loss_mask[lo:hi]
        assert out.batch.advantages[lo:hi] == packed.advantages[lo:hi]
    # The stand-in has the shape the sample's placeholders need, so the forward still lines up.
    assert out.mm_kwargs()["image_grid_thw"].tolist() == [
        r.descriptor["payload"]["image_grid_thw"][0] for r in packed.images
    ]
    assert (
        out.mm_kwargs()["pixel_values"].shape
        == make.reference_inputs([random_image(60 + 8 * i, 60, i) for i in range(3)])["pixel_values"].shape
    )


def loss_and_grads(model, materializer, batch: PackedMicroBatch, step_tokens: int):
    model.zero_grad(set_to_none=True)
    out = materializer.materialize(batch)
    new = forward_logprobs(
        model, out.batch, out.mm_kwargs(), materializer.forward_policy, normalizer=materializer.normalizer
    )
    mask = torch.tensor(out.batch.loss_mask) & ~sample_starts(out.batch.seq_lens)
    parts = batch_loss(new, out.batch, mask, step_tokens=step_tokens)
    parts.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return parts.loss.detach(), grads, int(parts.tokens)


def test_zero_loss_leaves_neighbours_loss_and_gradients_unchanged(make, tiny_qwen2_vl):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_qwen2_vl, dtype=torch.float32)
    first, broken, last = (
        make([random_image(60 + 8 * i, 56, i)], f"s{i}", advantage=i - 1.0) for i in range(3)
    )
    delete_image(make, broken)
    materializer = make.materializer("zero_loss")
    packed_loss, packed_grads, packed_tokens = loss_and_grads(
        model, materializer, concat_samples([first, broken, last]), step_tokens=10
    )
    # Reference: the neighbours without the broken sample at all, same normalizer.
    alone_loss, alone_grads, alone_tokens = loss_and_grads(
        model, materializer, concat_samples([first, last]), step_tokens=10
    )
    assert packed_tokens == alone_tokens > 0
    assert packed_loss != 0
    torch.testing.assert_close(packed_loss, alone_loss, rtol=1e-5, atol=1e-6)
    assert packed_grads.keys() == alone_grads.keys()
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, alone_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def tiny_model(tiny_qwen2_vl):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(tiny_qwen2_vl, dtype=torch.float32).eval()


def old_path_inputs(make: SampleMaker, batch: PackedMicroBatch, images: list[Image.Image]) -> dict:
    """The normalized float32 kwargs the trainer used to hold: the adapter's trainer path."""
    descriptors = [RawImageDescriptor.from_dict(r.descriptor) for r in batch.images]
    pixels = [np.array(image) for image in images]  # as the read decodes them
    return get_adapter("qwen_vl").materialize_for_trainer(pixels, descriptors, make.loaded).kwargs


def test_trainer_logprobs_on_uint8_pixels_equal_the_normalized_path(make, tiny_model):
    first, second = random_image(90, 60, 0), random_image(64, 100, 1)
    batch = concat_samples([make([first], "a"), make([first, second], "b")])
    materializer = make.materializer()
    out = materializer.materialize(batch)
    with torch.no_grad():
        want = forward_logprobs(
            tiny_model,
            batch,
            old_path_inputs(make, batch, [first, first, second]),
            materializer.forward_policy,
        )
        got = forward_logprobs(
            tiny_model,
            out.batch,
            out.mm_kwargs(),
            materializer.forward_policy,
            normalizer=materializer.normalizer,
        )
    assert torch.equal(got, want)  # bit-exact pixels, so bit-exact logprobs


def test_pixels_are_normalized_exactly_once(make, tiny_model):
    image = random_image(90, 60, 0)
    batch = concat_samples([make([image], "a")])
    materializer = make.materializer()
    out = materializer.materialize(batch)
    with pytest.raises(ValueError, match="need the materializer's normalizer"):  # skipped
        forward_logprobs(tiny_model, out.batch, out.mm_kwargs(), materializer.forward_policy)
    with pytest.raises(TypeError, match="normalized twice"):
        forward_logprobs(
            tiny_model,
            batch,
            old_path_inputs(make, batch, [image]),
            materializer.forward_policy,
            normalizer=materializer.normalizer,
        )


def test_misconfiguration_raises_even_under_zero_loss(make, tmp_path):
    sample = make([random_image(60, 60, 0)], "s")
    elsewhere = RawImageMaterializer(
        make.loaded, roots=[tmp_path / "other-root"], missing_image_policy="zero_loss"
    )
    with pytest.raises(InvalidImageRef, match="outside_offload_root"):
        elsewhere.materialize(concat_samples([sample]))


def test_family_mismatch_is_rejected(make):
    kimi = Sample(
        token_ids=[1, 2],
        mm_token_type_ids=[1, 0],
        loss_mask=[False, True],
        advantages=[0.0, 1.0],
        logprobs=[0.0, -1.0],
        mm_refs=build_mm_refs(
            [{"family": "kimi_k25", "modality": "image", "payload": {}, "raw_image_uri": "file:///x.png"}],
            ["a" * 32],
            [{"offset": 0, "length": 1}],
        ),
    )
    with pytest.raises(ValueError, match="family 'kimi_k25'"):
        make.materializer().materialize(concat_samples([kimi]))


def test_an_offload_root_given_through_a_symlink_is_read(make, tmp_path):
    # The trainer resolves its roots once; the read confines to resolved roots only.
    link = tmp_path / "offload-link"
    link.symlink_to(make.store.root, target_is_directory=True)
    image = random_image(60, 40, 0)
    through_link = RawImageMaterializer(make.loaded, roots=[link], missing_image_policy="error")
    got = through_link.materialize(concat_samples([make([image], "s")]))
    assert torch.equal(make.model_inputs(got)["pixel_values"], make.reference_inputs([image])["pixel_values"])


def test_distinct_images_are_read_on_threads_as_one_would(make, monkeypatch):
    """A micro-batch's distinct images are read and processed on `workers` threads; the tensors, stats
    and the handling of a missing image are those of reading them one by one."""
    images = [random_image(60 + 8 * i, 60, i) for i in range(3)]
    samples = [make([images[0], images[1]], "a"), make([images[2]], "b"), make([images[0]], "c")]
    delete_image(make, samples[1])
    threads: list[str] = []
    load = RawImageMaterializer._load

    def recorded(self, image):
        threads.append(threading.current_thread().name)
        return load(self, image)

    monkeypatch.setattr(RawImageMaterializer, "_load", recorded)
    outs, stats = [], []
    for workers in (1, 4):
        threads.clear()
        m = RawImageMaterializer(
            make.loaded, roots=[make.store.root], missing_image_policy="zero_loss", workers=workers
        )
        m.begin_step(1)
        outs.append(m.materialize(concat_samples(samples)))
        stats.append((m.stats.images, m.stats.materialized, m.stats.missing, m.stats.held_bytes))
        named = {name.startswith("materialize") for name in threads}
        assert named == ({True} if workers > 1 else {False}) and len(threads) == 3  # each distinct image once
    assert stats[0] == stats[1] == (4, 2, 1, stats[0][3])
    assert outs[0].batch == outs[1].batch and outs[0].missing == outs[1].missing
    for key, value in outs[0].mm_kwargs().items():
        torch.testing.assert_close(outs[1].mm_kwargs()[key], value, rtol=0, atol=0)
