"""What every model family knows: image layout from width/height and processor config alone."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Literal, TypeVar, cast, get_args

from rawmm.contract.errors import InvalidImageRef

# transformers' two image-processor backends; they produce different pixel values, so a processor
# identity (and its fingerprint) names the backend. The run config's processor_backend is this type.
Backend = Literal["pil", "torchvision"]
BACKENDS: tuple[str, ...] = get_args(Backend)
PREPROCESSOR_CONFIG = "preprocessor_config.json"
FINGERPRINT_HEX_CHARS = 16

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

# A family's config is a frozen dataclass (its fields are the fingerprint's input).
ConfigT = TypeVar("ConfigT", bound="DataclassInstance")


@dataclass(frozen=True)
class Layout:
    """Where one image goes: the processor's grid and how many prompt tokens stand for it."""

    grid_thw: tuple[int, int, int]
    resized: tuple[int, int]  # (height, width) the image is resized to, before any padding
    num_placeholder_tokens: int  # tokens the prompt holds for this image
    num_vision_tokens: int  # embeddings the vision tower emits for this image


def check_backend(backend: str) -> str:
    """``backend`` if it is one of ``BACKENDS``, else a ValueError naming them."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown image-processor backend {backend!r}; expected one of {BACKENDS}")
    return backend


def check_size(width: Any, height: Any) -> tuple[int, int]:
    for name, value in (("width", width), ("height", height)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"image {name} must be a positive integer, got {value!r}")
    return width, height


def read_preprocessor_config(path: str | Path) -> dict[str, Any]:
    """The ``preprocessor_config.json`` of a checkpoint directory (or the file itself)."""
    path = Path(path)
    file = path / PREPROCESSOR_CONFIG if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no {PREPROCESSOR_CONFIG} at {path}")
    return read_json_object(file)


def read_json_object(file: Path) -> dict[str, Any]:
    """A checkpoint's JSON file, which must hold an object (``ValueError`` naming the file otherwise)."""
    try:
        data = json.loads(file.read_text())
    except ValueError as exc:  # not UTF-8, or not JSON
        raise ValueError(f"{file} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file} does not hold a JSON object")
    return data


def parse_grid_list(payload: Any, key: str) -> tuple[int, int, int]:
    """``payload[key]`` must be ``[[t, h, w]]`` of positive ints; anything else is ``malformed_ref``."""
    grids = payload.get(key) if isinstance(payload, Mapping) else None
    if (
        not isinstance(grids, list)
        or len(grids) != 1
        or not isinstance(grids[0], list)
        or len(grids[0]) != 3
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in grids[0])
    ):
        raise InvalidImageRef("malformed_ref", f"payload must be {{{key!r}: [[t, h, w]]}} of positive ints")
    t, h, w = grids[0]
    return (t, h, w)


class Family(ABC, Generic[ConfigT]):
    """A model family's layout math and payload format. Stateless; one shared instance per family."""

    name: ClassVar[str]
    modality: ClassVar[str] = "image"
    vllm_modality: ClassVar[str | None] = None
    # The single token the chat template renders per image, expanded to the layout's placeholder count.
    placeholder_token: ClassVar[str]
    config_type: ClassVar[type]
    # The family's record: everything else (the run config's preset type, model_type detection) derives
    # from these. `preset_names` is a Literal type so the run config can type-check presets.
    preset_names: ClassVar[Any]
    presets: ClassVar[Mapping[str, Any]]
    # config.json `model_type` values of the family's checkpoints.
    model_types: ClassVar[tuple[str, ...]]
    # preprocessor_config.json keys that identify the family when config.json names no known model_type.
    preprocessor_markers: ClassVar[tuple[str, ...]] = ()
    # The backend of the processor vLLM's own image path runs for this family: every side's default, so a
    # run that names none materializes the pixels a chat request to the same engine would see.
    default_backend: ClassVar[Backend]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if set(get_args(cls.preset_names)) != set(cls.presets):
            raise TypeError(
                f"{cls.__name__}: preset_names {get_args(cls.preset_names)} != presets {set(cls.presets)}"
            )

    @property
    def engine_modality(self) -> str:
        return self.vllm_modality or self.modality

    def preset(self, name: str) -> ConfigT:
        try:
            return cast(ConfigT, self.presets[name])
        except KeyError:
            raise ValueError(
                f"family {self.name} has no preset {name!r}; presets: {sorted(self.presets)}"
            ) from None

    def fingerprint(self, config: ConfigT, backend: str) -> str:
        """Short digest of the processor identity: family, layout/pixel config values and backend."""
        if not isinstance(config, self.config_type):
            raise TypeError(
                f"family {self.name} needs a {self.config_type.__name__}, got {type(config).__name__}"
            )
        identity = {
            "family": self.name,
            "config": dataclasses.asdict(config),
            "backend": check_backend(backend),
        }
        blob = json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:FINGERPRINT_HEX_CHARS]

    @abstractmethod
    def config_from_pretrained(self, path: str | Path) -> ConfigT:
        """The config a checkpoint directory's preprocessor config describes (read locally, no network)."""

    @abstractmethod
    def config_from_processor(self, processor: Any) -> ConfigT:
        """The config of a loaded image processor (or a processor holding one as ``.image_processor``)."""

    @abstractmethod
    def describe(self, *, width: int, height: int, config: ConfigT) -> Layout:
        """The layout of a ``width`` x ``height`` image, from the config alone (no processor run)."""

    @abstractmethod
    def payload(self, layout: Layout) -> dict[str, Any]:
        """The family-owned, JSON-safe descriptor payload for ``layout``."""

    @abstractmethod
    def grid_from_payload(self, payload: Any) -> tuple[int, int, int]:
        """The grid a descriptor payload claims; a malformed payload is ``malformed_ref``."""
