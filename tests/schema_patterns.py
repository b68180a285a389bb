"""The check that a parser and the schema pattern the API server applies to the same field agree."""

from __future__ import annotations

import re
from collections.abc import Callable


def parser_agrees_with_pattern(parse: Callable[[str], object], pattern: str, text: str) -> bool:
    """Whether ``parse`` accepts ``text`` exactly when ``pattern`` matches all of it, as the API server
    matches a schema pattern (RE2's ``$`` is the end of the text)."""
    try:
        parse(text)
        parses = True
    except ValueError:
        parses = False
    return (re.fullmatch(pattern, text) is not None) == parses
