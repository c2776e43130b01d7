"""Pure Triton kernels and their launch configs (no op registration here)."""
