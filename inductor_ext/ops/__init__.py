"""Registered fastops operators (importing this module registers them)."""

from inductor_ext.ops.rms_norm import rms_norm, rms_norm_ref

__all__ = ["rms_norm", "rms_norm_ref"]
