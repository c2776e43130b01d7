"""Patch instantiated HF transformers models onto our ops: :func:`apply`, :func:`unapply`, :func:`patched`."""

from inductor_ext.models.families import FAMILIES
from inductor_ext.models.patch import PatchReport, PatchWarning, apply, patched, unapply

__all__ = ["FAMILIES", "PatchReport", "PatchWarning", "apply", "patched", "unapply"]
