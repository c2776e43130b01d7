"""Everything about tuning: search spaces, first-launch tuning, random inputs, timing, the tuning database,
route timing and the standalone tuner's command line (``python -m inductor_ext.tuning``). See
docs/autotune.md, which follows a config from its search space to the database and into a compiled graph.

The modules span layers (``tests/test_layering.py``), bottom to top:

* ``search_spaces`` (``order``, ``norm``): the configs a kernel's autotuner may choose from, heuristic's
  favourite first; the kernels import them.
* ``database`` (the JSON tuning database), ``kernel_configs`` (our kernels' configs in it),
  ``launch_settings`` (quick or thorough first launches, a forced config, launch logs), ``first_launch``
  (how an eager first launch tunes, and its picks), ``timing`` (signatures, GPU medians), ``inputs``
  (realistic random inputs per op schema), ``agreement`` (one decision for every rank): read by the
  launches of :mod:`inductor_ext.library.launch`.
* ``routes``: our kernels against Inductor's code for one op call, timed and stored; beside the backend,
  whose options it compiles with.
* ``cli`` (and ``__main__``): the standalone tuner, which traces a model through the backend's rewrites.

Importing the package imports none of them.
"""
