"""A tour of the raw-image contract on a tiny local checkpoint (runs in seconds, downloads nothing).

1. build a tiny random-weight Qwen2-VL checkpoint (model, tokenizer, processor);
2. ingest a few generated images, given in three different message shapes, into an offload store;
3. render a two-turn, multi-image chat: token ids with N placeholder tokens per image, computed from
   the layout math alone, plus one raw image descriptor per image;
4. print each image's layout and ref, and the request features an engine receives.

    .venv/bin/python examples/contract_tour.py [--workdir DIR]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import tempfile
from pathlib import Path

from PIL import Image, ImageDraw

from rawmm.contract import OffloadStore, detect_family, get_family, parse_ref, render_chat
from rawmm.run.tiny import build_tiny_model


def drawing(size: tuple[int, int], colour: str, shape: str) -> Image.Image:
    image = Image.new("RGB", size, "white")
    box = (size[0] // 4, size[1] // 4, 3 * size[0] // 4, 3 * size[1] // 4)
    (ImageDraw.Draw(image).ellipse if shape == "circle" else ImageDraw.Draw(image).rectangle)(
        box, fill=colour
    )
    return image


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workdir", type=Path, help="where the checkpoint and the store go (default: a temp dir)"
    )
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="rawmm-tour-"))

    checkpoint = build_tiny_model("qwen2_vl", workdir / "tiny-qwen2-vl", seed=0)
    print(f"1. tiny checkpoint: {checkpoint}")

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    family = detect_family(checkpoint)
    config = family.config_from_pretrained(checkpoint)
    store = OffloadStore(workdir / "images")
    square, circle, wide = (
        drawing((320, 240), "red", "square"),
        drawing((200, 200), "blue", "circle"),
        drawing((900, 120), "green", "square"),
    )
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Which shape is red? "},
                {
                    "type": "image_url",
                    "image_url": {
                        "url": "data:image/png;base64," + base64.b64encode(png_bytes(square)).decode()
                    },
                },
                {"type": "image", "image": circle},
            ],
        },
        {"role": "assistant", "content": "The square."},
        {
            "role": "user",
            "content": [{"type": "image", "image": png_bytes(wide)}, {"type": "text", "text": "And here?"}],
        },
    ]

    rendered = render_chat(messages, tokenizer=tokenizer, family=family, config=config, store=store)
    print(f"2. offload store {store.root}: {sum(1 for p in store.root.rglob('*') if p.is_file())} files")
    print(
        f"3. rendered {len(rendered.token_ids)} tokens, {sum(rendered.mm_token_type_ids)} of them image placeholders"
    )
    kimi = get_family("kimi_k25")
    for image, picture in zip(rendered.images, (square, circle, wide), strict=True):
        layout = family.describe(width=picture.width, height=picture.height, config=config)
        kimi_layout = kimi.describe(
            width=picture.width, height=picture.height, config=kimi.preset("kimi_k25")
        )
        print(
            f"   {picture.width}x{picture.height}: qwen grid {list(layout.grid_thw)} -> tokens "
            f"[{image.offset}, {image.offset + image.length}) | kimi_k25 would use grid {list(kimi_layout.grid_thw)} "
            f"behind 1 <|media_pad|>"
        )
        ref = parse_ref(image.ref)
        assert store.read_verified(ref.raw_image_uri, ref.mm_hash)  # consumers verify bytes against the ref
    print(f"   ref: {rendered.images[0].ref}")
    features = rendered.features()
    print("4. request features:")
    print(
        json.dumps(
            {
                **features,
                "kwargs_data": {k: [r[:60] + "..." for r in v] for k, v in features["kwargs_data"].items()},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
