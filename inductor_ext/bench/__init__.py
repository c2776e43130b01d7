"""Benchmarks: ``python -m inductor_ext.bench <op>`` (needs a CUDA GPU)."""
