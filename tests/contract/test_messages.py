import base64
import copy
import io
from pathlib import Path

import pydantic
import pytest
from PIL import Image

from rawmm.contract import ImageIngestError, OffloadStore, offload_message_images


def png(colour: str) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (9, 6), colour).save(buffer, format="PNG")
    return buffer.getvalue()


class TypedTextPart(pydantic.BaseModel):
    type: str = "text"
    text: str


class TypedImagePart(pydantic.BaseModel):
    type: str = "image_url"
    image_url: dict[str, str]


def test_every_image_part_shape_becomes_a_file_image_url(offload_store: OffloadStore, tmp_path: Path) -> None:
    data = png("red")
    data_url = "data:image/png;base64," + base64.b64encode(data).decode()
    local = tmp_path / "red.png"
    local.write_bytes(data)
    stored_uri = offload_store.put(data).uri
    shapes = [
        {"type": "image_url", "image_url": {"url": data_url, "detail": "high"}},
        {"type": "image_url", "image_url": data_url},
        {"type": "image", "image": data},
        {"type": "image", "image": Image.open(io.BytesIO(data))},
        {"type": "image", "image": str(local)},
        {"type": "image", "url": data_url},
        {"type": "image", "path": str(local)},
        {"type": "image_url", "image_url": {"url": stored_uri}},
        TypedImagePart(image_url={"url": data_url}),
    ]
    messages = [
        {"role": "system", "content": "plain text stays"},
        {"role": "user", "content": [{"type": "text", "text": "look:"}, *shapes]},
        {"role": "user", "content": [TypedTextPart(text="typed")]},
    ]
    before = copy.deepcopy([messages[0], {**messages[1], "content": messages[1]["content"][:3]}])
    out = offload_message_images(messages, offload_store)
    assert out[0] == {"role": "system", "content": "plain text stays"}
    assert out[1]["content"][0] == {"type": "text", "text": "look:"}
    rewritten = out[1]["content"][1:]
    # PIL re-encodes to PNG, so it may differ from the original bytes; every other source is the same file.
    pil_uri = rewritten.pop(3)["image_url"]["url"]
    assert pil_uri.startswith(f"file://{offload_store.root}/")
    assert rewritten == [{"type": "image_url", "image_url": {"url": stored_uri}}] * (len(shapes) - 1)
    assert out[2]["content"] == [{"type": "text", "text": "typed"}]
    assert [messages[0], {**messages[1], "content": messages[1]["content"][:3]}] == before  # input untouched


@pytest.mark.parametrize(
    ("part", "match"),
    [
        (
            {"type": "input_audio", "input_audio": {}},
            r"message 1 part 1: unsupported content part type 'input_audio'",
        ),
        ({"type": "image_url", "image_url": {}}, r"message 1 part 1: image_url part has no URL"),
        ({"type": "image"}, r"message 1 part 1: image part has none of the keys"),
        ({"type": "image", "image": "https://example.com/cat.png"}, r"message 1 part 1: cannot ingest"),
        (
            {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}},
            r"message 1 part 1: outside_offload_root",
        ),
        ("just a string", r"message 1 part 1: content part must be an object"),
    ],
)
def test_unknown_or_broken_parts_are_errors_naming_the_part(
    offload_store: OffloadStore, part: object, match: str
) -> None:
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": "t"}, part]},
    ]
    with pytest.raises(ImageIngestError, match=match):
        offload_message_images(messages, offload_store)
