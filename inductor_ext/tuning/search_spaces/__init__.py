"""Search spaces: the launch configs a kernel's ``@triton.autotune`` may choose from, heuristic's favourite
first.

* :mod:`inductor_ext.tuning.search_spaces.order`: pruning that keeps a search space's order
  (:func:`~inductor_ext.tuning.search_spaces.order.in_search_order`), used by every kernel's
  ``early_config_prune``.
* :mod:`inductor_ext.tuning.search_spaces.norm`: the configs of the row-normalisation kernels (RMSNorm,
  LayerNorm): :class:`~inductor_ext.tuning.search_spaces.norm.NormConfig`, its search space and heuristic.

A kernel whose space serves it alone declares it beside the kernel (``CrossEntropyConfig`` in
:mod:`inductor_ext.kernels.cross_entropy`, ``RoPEConfig``, ``GLUConfig``). These modules import only Triton:
the kernels import them.
"""
