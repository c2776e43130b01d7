"""Options of the ``fastops_inductor`` backend.

Set them per compile through ``torch.compile(model, backend="fastops_inductor",
options={...})`` (keys below; any other key is an Inductor config patch, e.g.
``"cpp_wrapper": True``), or for the whole process with the environment variables
named next to each. An explicit option beats the environment, which beats the default.

``fastops.route`` (``INDUCTOR_EXT_ROUTE``)
    How each fastops op is compiled: ``"kernel"`` (our Triton kernels, launched by
    Inductor), ``"inductor"`` (Inductor generates the code from the op's aten math) or
    ``"auto"`` (default: time both at the graph's shapes on random inputs at compile
    time and keep the faster; on CPU the Inductor route). A dict sets it per op family,
    ``{"rms_norm": "kernel", "default": "auto"}``; the environment form is
    ``"auto,rms_norm=kernel"``.
``fastops.multi_kernel`` (``INDUCTOR_EXT_MULTI_KERNEL``)
    Inductor's ``triton.multi_kernel`` for our backend: 1 (default) emits persistent
    and looped variants of each reduction and keeps the faster at run time; 0 turns it
    off. If ``TORCHINDUCTOR_MULTI_KERNEL`` is set, or ``triton.multi_kernel`` is passed
    as an option, that value is used instead.
``fastops.patterns`` (``INDUCTOR_EXT_PATTERNS``)
    Rewrite common PyTorch spellings (HF ``LlamaRMSNorm``, ``F.rms_norm``, ...) into
    fastops ops before compiling (default true).
``fastops.causal_mask`` (``INDUCTOR_EXT_CAUSAL_MASK``)
    Call ``scaled_dot_product_attention`` with ``is_causal=True`` and no mask where the
    graph's mask is proven to be the causal mask (default true; :mod:`.causal_mask`).
``fastops.document_mask`` (``INDUCTOR_EXT_DOCUMENT_MASK``)
    Run SDPA calls whose mask is proven to be transformers' packed-document mask (causal within
    each document of ``position_ids``) as block-sparse FlexAttention that skips cross-document
    blocks (default true; :mod:`.document_mask`).
``fastops.assume_no_padding`` (``INDUCTOR_EXT_ASSUME_NO_PADDING``)
    Promise that 2-D integer/boolean graph inputs that attention masks are built from
    (HF's ``attention_mask``) hold no padding, so a mask built from them can be proven
    causal too (default false). A device-side assertion checks the promise at run time,
    with no host sync: a mask with padding stops the program with an error.
``fastops.recompute_norms`` (``INDUCTOR_EXT_RECOMPUTE_NORMS``)
    Recompute in the backward the RMSNorm/LayerNorm outputs that feed matrix products instead of
    saving them (default true; :mod:`.recompute`): one norm-forward kernel per norm in the backward,
    ``N H`` elements less saved per norm (1 GiB for Llama-3.2-1B at 8192 tokens).
``fastops.recompute_glu`` (``INDUCTOR_EXT_RECOMPUTE_GLU``)
    The same for the SwiGLU/GeGLU output that feeds the down projection (default false): one GLU
    kernel per layer in the backward, ``N I`` elements less saved per layer (2 GiB for Llama-3.2-1B
    at 8192 tokens).
``fastops.lazy_linear_outputs`` (``INDUCTOR_EXT_LAZY_LINEAR_OUTPUTS``)
    Return a graph output computed by a widening linear layer and read inside the graph too (HF's logits
    next to the loss) detached, re-attached to autograd outside the compiled graph, so an unused one
    costs no zero gradient of its size (default true; :mod:`.lazy_outputs`).
``fastops.fuse_projections`` (``INDUCTOR_EXT_FUSE_PROJECTIONS``)
    Compute sibling linear projections of one input, one of them narrower than the input (grouped-query
    attention's q/k/v), as one matrix product over their concatenated weights (default false;
    :mod:`.sibling_projections`): one product a direction instead of three and no sum of the input
    gradients, for a copy of the weights and of the output gradients. Off until a training step on the
    GPU measures it (the layer's projections alone measure 1.10x at Llama-3.2-1B's shape).
``fastops.accumulate_products`` (``INDUCTOR_EXT_ACCUMULATE_PRODUCTS``)
    Compute a sum of matrix products (the backward's input gradient of a tensor that feeds several linear
    layers: q/k/v, gate/up) as one product followed by the others added in their GEMMs' epilogues, instead
    of separate products and a pointwise sum (default true; :mod:`.product_sums`): the Llama-3.2-1B
    training step on an H100 took 2.2 ms less GPU time and 1.2 ms less wall time with it (1.010x tokens/s).
``cpp_wrapper`` (``INDUCTOR_EXT_CPP_WRAPPER``)
    Inductor's C++ wrapper; with it, ``triton.autotune_at_compile_time`` is forced on
    (torch 2.13 otherwise defaults it off and asserts with multi-kernel).
"""

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from inductor_ext.env import env_flag

ROUTES = ("auto", "kernel", "inductor")
OPTION_NAMES = (
    "route",
    "multi_kernel",
    "patterns",
    "causal_mask",
    "document_mask",
    "assume_no_padding",
    "recompute_norms",
    "recompute_glu",
    "lazy_linear_outputs",
    "fuse_projections",
    "accumulate_products",
)
"""Our options, each spelled ``fastops.<name>`` in ``options``."""
_PREFIX = "fastops."


@dataclasses.dataclass(frozen=True)
class BackendOptions:
    default_route: str = "auto"
    routes: tuple[tuple[str, str], ...] = ()
    """Per-family overrides of ``default_route``, as sorted ``(family, route)`` pairs."""
    multi_kernel: int | None = 1
    """None: leave Inductor's own setting (``TORCHINDUCTOR_MULTI_KERNEL`` or an explicit option)."""
    patterns: bool = True
    cpp_wrapper: bool = False
    causal_mask: bool = True
    assume_no_padding: bool = False
    document_mask: bool = True
    recompute_norms: bool = True
    recompute_glu: bool = False
    lazy_linear_outputs: bool = True
    fuse_projections: bool = False
    accumulate_products: bool = True

    def route_for(self, family: str) -> str:
        return dict(self.routes).get(family, self.default_route)

    def inductor_patches(self) -> dict[str, Any]:
        patches: dict[str, Any] = {}
        if self.multi_kernel is not None:
            patches["triton.multi_kernel"] = self.multi_kernel
        if self.cpp_wrapper:
            patches["cpp_wrapper"] = True
            patches["triton.autotune_at_compile_time"] = True
        return patches


def parse_options(
    options: Mapping[str, Any] | None, env: Mapping[str, str] = os.environ, *, default_multi_kernel: int | None = 1
) -> tuple[BackendOptions, dict[str, Any]]:
    """Split ``torch.compile``'s ``options`` into ours and Inductor config patches.

    ``default_multi_kernel`` applies when neither an option nor the environment sets it
    (None: leave Inductor's setting, as exports do).
    """
    from torch._inductor import config as inductor_config

    options = dict(options or {})
    ours = {k[len(_PREFIX) :]: options.pop(k) for k in list(options) if k.startswith(_PREFIX)}
    unknown = set(ours) - set(OPTION_NAMES)
    if unknown:
        known = ", ".join(_PREFIX + k for k in OPTION_NAMES)
        raise ValueError(f"fastops_inductor: unknown options {sorted(_PREFIX + k for k in unknown)}; known: {known}")

    route = ours.get("route", env.get("INDUCTOR_EXT_ROUTE", "auto"))
    default_route, routes = _parse_route(route)

    if "multi_kernel" in ours:
        multi_kernel: int | None = int(ours["multi_kernel"])
    elif "triton.multi_kernel" in options or "TORCHINDUCTOR_MULTI_KERNEL" in env:
        multi_kernel = None
    else:
        multi_kernel = (
            int(env["INDUCTOR_EXT_MULTI_KERNEL"]) if "INDUCTOR_EXT_MULTI_KERNEL" in env else default_multi_kernel
        )

    patterns = ours.get("patterns", env_flag(env, "INDUCTOR_EXT_PATTERNS", True))
    # a process-wide torch._inductor.config.cpp_wrapper counts too (it needs compile-time autotuning as well)
    cpp_wrapper = bool(
        options.pop("cpp_wrapper", env_flag(env, "INDUCTOR_EXT_CPP_WRAPPER", inductor_config.cpp_wrapper))
    )
    causal_mask = ours.get("causal_mask", env_flag(env, "INDUCTOR_EXT_CAUSAL_MASK", True))
    assume_no_padding = ours.get("assume_no_padding", env_flag(env, "INDUCTOR_EXT_ASSUME_NO_PADDING", False))
    document_mask = ours.get("document_mask", env_flag(env, "INDUCTOR_EXT_DOCUMENT_MASK", True))
    recompute_norms = ours.get("recompute_norms", env_flag(env, "INDUCTOR_EXT_RECOMPUTE_NORMS", True))
    recompute_glu = ours.get("recompute_glu", env_flag(env, "INDUCTOR_EXT_RECOMPUTE_GLU", False))
    lazy_linear_outputs = ours.get("lazy_linear_outputs", env_flag(env, "INDUCTOR_EXT_LAZY_LINEAR_OUTPUTS", True))
    fuse_projections = ours.get("fuse_projections", env_flag(env, "INDUCTOR_EXT_FUSE_PROJECTIONS", False))
    accumulate_products = ours.get("accumulate_products", env_flag(env, "INDUCTOR_EXT_ACCUMULATE_PRODUCTS", True))
    parsed = BackendOptions(
        default_route, routes, multi_kernel, bool(patterns), cpp_wrapper, bool(causal_mask), bool(assume_no_padding),
        bool(document_mask), bool(recompute_norms), bool(recompute_glu), bool(lazy_linear_outputs),
        bool(fuse_projections), bool(accumulate_products),
    )  # fmt: skip
    return parsed, options


def _parse_route(route: str | Mapping[str, str]) -> tuple[str, tuple[tuple[str, str], ...]]:
    if isinstance(route, str):
        entries = dict(_split_env_route(route))
    elif isinstance(route, Mapping):
        entries = dict(route)
    else:
        raise TypeError(f"fastops_inductor: fastops.route must be a str or a dict, got {type(route).__name__}")
    for family, value in entries.items():
        if value not in ROUTES:
            raise ValueError(f"fastops_inductor: route for {family!r} must be one of {ROUTES}, got {value!r}")
    default = entries.pop("default", "auto")
    return default, tuple(sorted(entries.items()))


def _split_env_route(text: str) -> list[tuple[str, str]]:
    """``"auto,rms_norm=kernel"`` -> ``[("default", "auto"), ("rms_norm", "kernel")]``."""
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        family, sep, value = item.partition("=")
        pairs.append((family.strip(), value.strip()) if sep else ("default", family))
    return pairs
