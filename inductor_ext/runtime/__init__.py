"""Export and run: AOTInductor packages, their loading from Python, and the C++ executables that run them.

The public entry points are re-exported by :mod:`inductor_ext` (``export``, ``load``, ``ExportError``,
``export_generation``, ``load_generation``). The modules:

* :mod:`inductor_ext.runtime.export`: ``export`` (``torch.export`` then AOTInductor, with the backend's
  route choice), ``load`` and ``load_models``.
* :mod:`inductor_ext.runtime.generation`: an HF causal LM's prefill and decode step over a static KV
  cache as one package (``export_generation``) and its generation loop in Python (``load_generation``).
* :mod:`inductor_ext.runtime.shared_weights`: the weights of a package with several graphs, stored once.
* :mod:`inductor_ext.runtime.cpp_runner`: builds and calls the C++ runner and generation loop
  (sources in ``inductor_ext/csrc/``).
* :mod:`inductor_ext.runtime.tensor_file`: the tensor file format those executables read and write.
* :mod:`inductor_ext.runtime.cxx_runtime`: makes the process's shared libstdc++ global before a package
  whose ``wrapper.so`` carries a static copy loads (docs/export.md).

Importing the package imports none of them.
"""
