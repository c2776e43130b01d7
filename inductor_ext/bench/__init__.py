"""The user-facing benchmarks: ``python -m inductor_ext.bench train|generate``."""
