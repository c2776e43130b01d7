"""inductor_ext: fused Triton kernels for LLM training and inference, as real PyTorch operators.

Importing the package registers the ``torch.ops.fastops.*`` operators and the
``fastops_inductor`` torch.compile backend. It does not initialise CUDA.
"""

from inductor_ext import nn
from inductor_ext.inductor import backend as _backend  # registers "fastops_inductor"
from inductor_ext.ops import rms_norm, rms_norm_ref

__version__ = "0.1.0"

__all__ = ["__version__", "nn", "rms_norm", "rms_norm_ref"]
