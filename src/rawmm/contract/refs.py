"""Raw image descriptors and the ``mmraw:`` ref strings that carry them over the wire
(docs/architecture.md §3.2).

A ref is ``mmraw:`` + compact JSON with sorted keys of
``{family, modality, mm_hash, payload, raw_image_uri[, fingerprint]}`` — no base64 wrapper, so it stays
wire-compatible with the published renderers format (which has no fingerprint). Parsing is strict and
total: any input that is not a well-formed ref raises ``InvalidImageRef("malformed_ref")`` and nothing else.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rawmm.contract.errors import InvalidImageRef
from rawmm.contract.families import vllm_modality_of

REF_PREFIX = "mmraw:"
# Refs hold a short URI and a tiny payload; anything this long is garbage or an attack.
MAX_REF_CHARS = 16_384
# Payloads are a few small lists; a bound keeps json from recursing on hostile nesting.
_MAX_PAYLOAD_DEPTH = 8

_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_MM_HASH_RE = re.compile(r"[a-f0-9]{16,128}")
_FINGERPRINT_RE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_REQUIRED_KEYS = frozenset({"family", "modality", "mm_hash", "payload", "raw_image_uri"})
_OPTIONAL_KEYS = frozenset({"fingerprint"})


def _malformed(message: str) -> InvalidImageRef:
    return InvalidImageRef("malformed_ref", message)


def _check_name(field: str, value: Any) -> str:
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        raise _malformed(f"{field} must match [A-Za-z0-9_.-]{{1,64}}, got {value!r:.80}")
    return value


def _check_uri(value: Any) -> str:
    if not isinstance(value, str) or not value.startswith("file://"):
        raise _malformed(f"raw_image_uri must be a file:// URI, got {value!r:.80}")
    # Any control character (Unicode Cc), not only NUL and line breaks: urlsplit silently drops tabs.
    if any(ch < "\x20" or "\x7f" <= ch <= "\x9f" for ch in value):
        raise _malformed("raw_image_uri contains control characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a JSON "\\ud800" escape: no file can have that name
        raise _malformed("raw_image_uri is not valid Unicode (lone surrogate)") from None
    return value


def _check_fingerprint(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not _FINGERPRINT_RE.fullmatch(value):
        raise _malformed(f"fingerprint must match [A-Za-z0-9_.:-]{{1,128}}, got {value!r:.80}")
    return value


def _depth(value: Any, limit: int) -> int:
    if limit < 0:
        return 0
    if isinstance(value, Mapping):
        return 1 + max((_depth(v, limit - 1) for v in value.values()), default=0)
    if isinstance(value, list | tuple):
        return 1 + max((_depth(v, limit - 1) for v in value), default=0)
    return 0


def _check_payload(value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise _malformed(f"payload must be a JSON object, got {type(value).__name__}")
    if _depth(value, _MAX_PAYLOAD_DEPTH) > _MAX_PAYLOAD_DEPTH:
        raise _malformed("payload is nested too deeply")
    return dict(value)


def check_mm_hash(value: Any) -> str:
    """Return ``value`` if it is a lower-case hex image hash of 16..128 characters, else ``malformed_ref``."""
    if not isinstance(value, str) or not _MM_HASH_RE.fullmatch(value):
        raise _malformed(f"mm_hash must be 16-128 lower-case hex characters, got {value!r:.80}")
    return value


@dataclass(frozen=True)
class RawImageDescriptor:
    """Everything a consumer needs to turn an offloaded image back into model inputs (JSON-safe)."""

    family: str
    modality: str
    payload: dict[str, Any]
    raw_image_uri: str
    fingerprint: str | None = None
    vllm_modality: str | None = None

    @property
    def engine_modality(self) -> str:
        """The key this image is filed under in request features and engine inputs."""
        return self.vllm_modality or self.modality

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "family": self.family,
            "modality": self.modality,
            "payload": self.payload,
            "raw_image_uri": self.raw_image_uri,
        }
        if self.fingerprint is not None:
            out["fingerprint"] = self.fingerprint
        if self.vllm_modality is not None:
            out["vllm_modality"] = self.vllm_modality
        return out

    @classmethod
    def from_dict(cls, data: Any) -> RawImageDescriptor:
        """Strictly rebuild a descriptor from ``to_dict`` output; anything else is ``malformed_ref``."""
        if not isinstance(data, Mapping):
            raise _malformed(f"descriptor must be an object, got {type(data).__name__}")
        allowed = {"family", "modality", "payload", "raw_image_uri", "fingerprint", "vllm_modality"}
        missing = {"family", "modality", "payload", "raw_image_uri"} - data.keys()
        extra = data.keys() - allowed
        if missing or extra:
            raise _malformed(
                f"descriptor keys: missing {sorted(missing)}, unexpected {sorted(map(str, extra))}"
            )
        vllm_modality = data.get("vllm_modality")
        return cls(
            family=_check_name("family", data["family"]),
            modality=_check_name("modality", data["modality"]),
            payload=_check_payload(data["payload"]),
            raw_image_uri=_check_uri(data["raw_image_uri"]),
            fingerprint=_check_fingerprint(data.get("fingerprint")),
            vllm_modality=None if vllm_modality is None else _check_name("vllm_modality", vllm_modality),
        )


@dataclass(frozen=True)
class RawImageRef:
    """A parsed ``mmraw:`` ref: a descriptor's wire fields plus the image's hash."""

    family: str
    modality: str
    mm_hash: str
    payload: dict[str, Any]
    raw_image_uri: str
    fingerprint: str | None = None

    @functools.cached_property
    def canonical(self) -> str:
        """The ref as ``encode_ref`` writes it, without re-validating what ``parse_ref`` already checked.

        Engines key their cache on it for every image of every request, so it stays a single ``json.dumps``.
        """
        return _ref_text(self._body())

    def _body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "family": self.family,
            "modality": self.modality,
            "mm_hash": self.mm_hash,
            "payload": self.payload,
            "raw_image_uri": self.raw_image_uri,
        }
        if self.fingerprint is not None:
            body["fingerprint"] = self.fingerprint
        return body

    def descriptor(self) -> RawImageDescriptor:
        """The descriptor this ref carries; ``vllm_modality`` comes from the family (None if unknown)."""
        return RawImageDescriptor(
            family=self.family,
            modality=self.modality,
            payload=self.payload,
            raw_image_uri=self.raw_image_uri,
            fingerprint=self.fingerprint,
            vllm_modality=vllm_modality_of(self.family),
        )


def _ref_text(body: dict[str, Any]) -> str:
    return REF_PREFIX + json.dumps(
        body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )


def encode_ref(descriptor: RawImageDescriptor, mm_hash: str) -> str:
    """Serialize ``descriptor`` + ``mm_hash`` as an ``mmraw:`` ref (compact JSON, sorted keys)."""
    body: dict[str, Any] = {
        "family": _check_name("family", descriptor.family),
        "modality": _check_name("modality", descriptor.modality),
        "mm_hash": check_mm_hash(mm_hash),
        "payload": _check_payload(descriptor.payload),
        "raw_image_uri": _check_uri(descriptor.raw_image_uri),
    }
    if descriptor.fingerprint is not None:
        body["fingerprint"] = _check_fingerprint(descriptor.fingerprint)
    text = _ref_text(body)
    if len(text) > MAX_REF_CHARS:
        raise _malformed(f"ref would be {len(text)} characters, over the {MAX_REF_CHARS} limit")
    return text


def _reject_constant(name: str) -> Any:
    raise _malformed(f"non-finite number {name} in ref JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise _malformed(f"number {text[:40]} overflows in ref JSON")
    return value


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Duplicate keys would let two parsers disagree on what a ref says; refuse them.
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _malformed(f"duplicate key {key!r} in ref JSON")
        out[key] = value
    return out


def parse_ref(text: Any) -> RawImageRef:
    """Parse an ``mmraw:`` ref; every malformed input raises ``InvalidImageRef("malformed_ref")``."""
    if not isinstance(text, str):
        raise _malformed(f"ref must be a string, got {type(text).__name__}")
    if len(text) > MAX_REF_CHARS:
        raise _malformed(f"ref is {len(text)} characters, over the {MAX_REF_CHARS} limit")
    if not text.startswith(REF_PREFIX):
        raise _malformed(f"ref must start with {REF_PREFIX!r}")
    body_text = text[len(REF_PREFIX) :]
    try:
        body_text.encode("utf-8")
        body = json.loads(
            body_text,
            object_pairs_hook=_unique_object,
            parse_constant=_reject_constant,
            parse_float=_finite_float,
        )
    except InvalidImageRef:
        raise
    except (ValueError, UnicodeError, RecursionError) as exc:
        raise _malformed(f"ref body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise _malformed(f"ref body must be a JSON object, got {type(body).__name__}")
    missing = _REQUIRED_KEYS - body.keys()
    extra = body.keys() - _REQUIRED_KEYS - _OPTIONAL_KEYS
    if missing or extra:
        raise _malformed(f"ref keys: missing {sorted(missing)}, unexpected {sorted(extra)}")
    return RawImageRef(
        family=_check_name("family", body["family"]),
        modality=_check_name("modality", body["modality"]),
        mm_hash=check_mm_hash(body["mm_hash"]),
        payload=_check_payload(body["payload"]),
        raw_image_uri=_check_uri(body["raw_image_uri"]),
        fingerprint=_check_fingerprint(body.get("fingerprint")),
    )
