"""The standalone tuner, ``python -m inductor_ext.tuning`` (console script ``inductor-ext-autotune``).

``calls`` (op calls and call files), ``trace`` (a model's calls, traced on meta tensors), ``tune`` (the
calls' routes into the database), ``report`` (progress and tables), ``main`` (the command line).
See docs/autotune.md.
"""
