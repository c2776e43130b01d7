"""Tuning on random inputs built from shapes alone, the tuning database, and the standalone tuner.

Shape-level building blocks, used by the backend's route choice
(:mod:`inductor_ext.inductor.choice`): ``database`` (the JSON tuning database),
``timing`` (signatures, GPU medians), ``inputs`` (realistic random inputs per op schema).
The standalone tuner on top of the backend (``python -m inductor_ext.autotune``):
``calls`` (op calls and call files), ``trace`` (a model's calls, traced on meta tensors),
``tune`` (into the database), ``report`` (progress and tables), ``__main__`` (the CLI).
See docs/autotune.md.
"""
