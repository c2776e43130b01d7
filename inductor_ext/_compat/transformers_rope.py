"""transformers' attention modules call their modeling module's ``apply_rotary_pos_emb`` by its global
name, so :func:`inductor_ext.models.apply` puts our RoPE there: for every model of that family in the
process while any patched one exists (the last ``unapply`` restores transformers' function)."""

from collections.abc import Callable
from typing import Any

from inductor_ext._compat import Patch

TESTED_TRANSFORMERS = ((5, 17), (5, 24))
"""The transformers versions whose modeling modules were checked to look ``apply_rotary_pos_emb`` up
at call time with the ``(q, k, cos, sin, ...)`` signature our replacement takes."""


def rope_patch(modeling_module: str, replacement: Callable[..., Any]) -> Patch:
    """The patch of ``modeling_module.apply_rotary_pos_emb`` (e.g. ``transformers.models.llama.modeling_llama``)."""
    return Patch(
        f"apply_rotary_pos_emb:{modeling_module}",
        f"{modeling_module}:apply_rotary_pos_emb",
        lambda original: replacement,
        tested=TESTED_TRANSFORMERS,
        upstream="transformers has no per-model RoPE hook: attention looks the function up in its module",
        package="transformers",
    )
