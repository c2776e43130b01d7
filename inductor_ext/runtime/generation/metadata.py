"""The package metadata that describes a generation step: flat strings (integers, comma-separated
lists of integers, names) under :data:`PREFIX`, which the C++ loop reads as easily as Python."""

from collections.abc import Mapping
from typing import Any

PREFIX = "inductor_ext.generation."
"""A key prefix of the package format (``csrc/generate.cpp`` reads it as ``kPrefix``), not this module's path."""


def encode(values: Mapping[str, Any]) -> dict[str, str]:
    """``{name: int | list[int] | str | None}`` as the package's string metadata (None: the empty string)."""

    def text(value: Any) -> str:
        if isinstance(value, (list, tuple)):
            return ",".join(str(int(v)) for v in value)
        return "" if value is None else str(value)

    return {PREFIX + name: text(value) for name, value in values.items()}


def decode(metadata: Mapping[str, str]) -> dict[str, str]:
    """The generation entries of a package's metadata, without the prefix (empty if there are none)."""
    return {k.removeprefix(PREFIX): v for k, v in metadata.items() if k.startswith(PREFIX)}


def decode_graph_name(batch: int) -> str:
    """The package's model name of the static decode graph for ``batch`` (``csrc/generate.cpp`` spells it too)."""
    return f"decode_batch_{batch}"
