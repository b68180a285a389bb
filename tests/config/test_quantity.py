"""Byte sizes: bytes and Kubernetes quantities, and the CRD pattern that must accept exactly the same text."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from schema_patterns import parser_agrees_with_pattern

from rawmm.config.quantity import BYTE_SIZE_PATTERN, parse_byte_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("1536", 1536),
        ("2Gi", 2 * 1024**3),
        ("1.5Ki", 1536),
        ("500M", 500_000_000),
        ("4k", 4000),
        (".5Mi", 512 * 1024),
        ("0.1k", 100),
        ("1.0001k", 1001),  # rounds up, as Kubernetes does for memory
        (4096, 4096),
    ],
)
def test_parse_byte_size_accepts_bytes_and_quantities(text: str | int, expected: int) -> None:
    assert parse_byte_size(text) == expected


@pytest.mark.parametrize(
    "text", ["", "2GB", "2gi", "-1", "1e3", "500m", "Gi", "1..5Gi", "1 Gi", " 2Gi", "2Gi\n", -1, True]
)
def test_parse_byte_size_rejects_with_the_value_in_the_message(text: str | int) -> None:
    with pytest.raises(ValueError, match="invalid byte size"):
        parse_byte_size(text)


# Quantity-like text and its near misses: whitespace, newlines, signs, exponents, other suffixes.
QUANTITY_LIKE = st.text(st.sampled_from("0123456789.kMGTPEi \n\t-+eB"), max_size=8) | st.from_regex(
    BYTE_SIZE_PATTERN
)


@given(QUANTITY_LIKE | st.text(max_size=8))
def test_crd_pattern_accepts_exactly_what_the_parser_accepts(text: str) -> None:
    assert parser_agrees_with_pattern(parse_byte_size, BYTE_SIZE_PATTERN, text)
