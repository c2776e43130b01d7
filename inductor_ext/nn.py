"""Drop-in ``nn.Module`` s calling the fastops functional ops."""

import torch
from torch import Tensor

from inductor_ext.ops.rms_norm import rms_norm


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` (same constructor and ``weight`` parameter) running :func:`inductor_ext.rms_norm`.

    Loads ``torch.nn.RMSNorm`` and HF ``LlamaRMSNorm`` state dicts (both hold one
    ``weight``). ``eps=None`` means 1e-6 (HF's default; ``torch.nn.RMSNorm``
    would use ``finfo(dtype).eps``). ``offset=1.0, casting="gemma"`` gives
    ``GemmaRMSNorm`` (whose checkpoints store ``w`` for ``1 + w``; build it
    with ``weight`` initialised to zeros to match a fresh Gemma module).
    """

    def __init__(
        self,
        normalized_shape: int | list[int] | torch.Size,
        eps: float | None = 1e-6,
        elementwise_affine: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        offset: float = 0.0,
        casting: str = "llama",
    ) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, device=device, dtype=dtype)
        if len(self.normalized_shape) != 1:
            raise ValueError(f"RMSNorm: normalized_shape must be one dimension, got {self.normalized_shape}")
        self.offset = offset
        self.casting = casting

    def forward(self, x: Tensor) -> Tensor:
        eps = 1e-6 if self.eps is None else self.eps
        return rms_norm(x, self.weight, eps, offset=self.offset, casting=self.casting)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, offset={self.offset}, casting={self.casting!r}"
