"""Scenes of coloured shapes, generated from a seed and drawn with PIL (no datasets).

A scene is one or more square *panels* side by side; each panel is a 3×3 grid of cells holding at
most one shape, so every shape has an unambiguous position name. World coordinates: panel `p`
covers x in [p, p+1] and y in [0, 1]. `draw` renders any box of the world at any pixel size, so
zooming and cropping give crisp new images rather than upscaled pixels.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from PIL import Image, ImageDraw

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (30, 160, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 200, 20),
}
KINDS = ("circle", "square", "triangle")
GRID = 3
POSITIONS = (
    ("top-left", "top", "top-right"),
    ("left", "center", "right"),
    ("bottom-left", "bottom", "bottom-right"),
)
_HALF_SIZE = 0.12  # of a panel's side: shapes never touch their cell's border (cells are 1/3)
_BACKGROUND = (245, 245, 240)


@dataclass(frozen=True)
class Shape:
    kind: str
    colour: str
    panel: int
    row: int
    col: int

    @property
    def position(self) -> str:
        return POSITIONS[self.row][self.col]

    @property
    def centre(self) -> tuple[float, float]:
        return self.panel + (self.col + 0.5) / GRID, (self.row + 0.5) / GRID


@dataclass(frozen=True)
class Box:
    """A rectangle of the world, in panel units."""

    x0: float
    y0: float
    x1: float
    y1: float

    @classmethod
    def panel(cls, index: int) -> Box:
        return cls(index, 0.0, index + 1.0, 1.0)

    def zoomed(self, factor: float = 2.0) -> Box:
        """The box `factor` times smaller around the same centre."""
        cx, cy = (self.x0 + self.x1) / 2, (self.y0 + self.y1) / 2
        hw, hh = (self.x1 - self.x0) / (2 * factor), (self.y1 - self.y0) / (2 * factor)
        return Box(cx - hw, cy - hh, cx + hw, cy + hh)

    def quadrant(self, name: str) -> Box:
        """One quarter of the box: `top-left`, `top-right`, `bottom-left` or `bottom-right`."""
        cx, cy = (self.x0 + self.x1) / 2, (self.y0 + self.y1) / 2
        vertical, horizontal = name.split("-")
        x0, x1 = (self.x0, cx) if horizontal == "left" else (cx, self.x1)
        y0, y1 = (self.y0, cy) if vertical == "top" else (cy, self.y1)
        return Box(x0, y0, x1, y1)


def random_panel(rng: random.Random, panel: int, *, min_shapes: int, max_shapes: int) -> list[Shape]:
    """Between `min_shapes` and `max_shapes` shapes in distinct cells of panel `panel`."""
    count = rng.randint(min_shapes, max_shapes)
    cells = rng.sample(range(GRID * GRID), count)
    return [
        Shape(
            kind=rng.choice(KINDS), colour=rng.choice(list(COLOURS)), panel=panel, row=c // GRID, col=c % GRID
        )
        for c in sorted(cells)
    ]


def draw(shapes: list[Shape], box: Box, size: int) -> Image.Image:
    """Render the part of the world inside `box` as a `size`×`size` RGB image."""
    image = Image.new("RGB", (size, size), _BACKGROUND)
    canvas = ImageDraw.Draw(image)
    sx, sy = size / (box.x1 - box.x0), size / (box.y1 - box.y0)

    def to_pixels(x: float, y: float) -> tuple[float, float]:
        return (x - box.x0) * sx, (y - box.y0) * sy

    for shape in shapes:
        cx, cy = shape.centre
        left, top = to_pixels(cx - _HALF_SIZE, cy - _HALF_SIZE)
        right, bottom = to_pixels(cx + _HALF_SIZE, cy + _HALF_SIZE)
        if right < 0 or bottom < 0 or left > size or top > size:
            continue
        fill = COLOURS[shape.colour]
        if shape.kind == "circle":
            canvas.ellipse((left, top, right, bottom), fill=fill)
        elif shape.kind == "square":
            canvas.rectangle((left, top, right, bottom), fill=fill)
        else:
            canvas.polygon([((left + right) / 2, top), (right, bottom), (left, bottom)], fill=fill)
    return image
