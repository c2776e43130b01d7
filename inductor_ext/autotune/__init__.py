"""The standalone tuner on top of the backend (``python -m inductor_ext.autotune``).

``calls`` (op calls and call files), ``trace`` (a model's calls, traced on meta tensors),
``tune`` (into the database), ``report`` (progress and tables), ``__main__`` (the CLI).
The database, timing and random inputs it uses live in :mod:`inductor_ext.tuning`.
See docs/autotune.md.
"""
