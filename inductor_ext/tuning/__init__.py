"""Shape-level tuning services: the tuning database and timing on random inputs built from shapes alone.

Read by the ops (:mod:`inductor_ext.library.launch`: recorded launch configs) and by the backend's
route choice (:mod:`inductor_ext.inductor.choice`); written by the standalone tuner
(:mod:`inductor_ext.autotune`). Modules: ``database`` (the JSON tuning database),
``kernel_configs`` (our kernels' launch configs in it), ``timing`` (signatures, GPU medians),
``inputs`` (realistic random inputs per op schema). Imports only from :mod:`inductor_ext.kernels`
and below. See docs/autotune.md.
"""
