"""The op-definition core: the one place that touches ``torch.library`` mechanics; every op file uses it.

An op file (:mod:`inductor_ext.ops`) supplies its math, its kernel launches and its autograd rule;
this package turns them into registered ``fastops`` operators and launches their kernels (two
ops with no Triton kernel of their own, ``fastops::sum_of_products`` and
``fastops::embedding_dense_backward_aten``, are plain ``torch.library.custom_op`` functions in their op
files). Its modules, top to bottom (each imports only the ones below it):

* :mod:`inductor_ext.library.registration`: the ``fastops`` namespace and the op recipe
  (:func:`~inductor_ext.library.registration.define_op_family` and the other ``define_*`` helpers:
  ``triton_op`` forward and backward, autograd, the eager bypass, decompositions), and the registries
  the backend, the tuner and export read (``FAMILIES``, ``DECOMPOSITIONS``, ``route_ops``).
* :mod:`inductor_ext.library.launch`: kernel launches, traced inside registered ops
  (``TraceableLaunch``) or direct in plain eager (``DirectLaunch``). How a first launch tunes, its
  settings and the configs recorded in the tuning database are :mod:`inductor_ext.tuning`'s.
* :mod:`inductor_ext.library.sharding`: the DTensor sharding rules an op file declares beside its op
  (:func:`~inductor_ext.library.sharding.sharding_rule`), the placement helpers they share, and their
  registration with DTensor (it imports none of the modules above).

Importing the package imports none of them.
"""
