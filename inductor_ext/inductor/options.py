"""Options of the ``fastops_inductor`` backend, of :func:`inductor_ext.export` and of ``export_generation``.

Set them per compile through ``torch.compile(model, backend="fastops_inductor", options={...})``
(``fastops.<name>`` keys; any other key is an Inductor config patch, e.g. ``"cpp_wrapper": True``),
or for the whole process with the ``INDUCTOR_EXT_<NAME>`` environment variables. An explicit option
beats the environment, which beats the default. Each graph pass that users can switch is an option
of its own, declared once where it is registered (:mod:`inductor_ext.inductor.passes`); the settings
below are the others. :func:`options_table` renders all of them for docs/backend.md.
"""

import dataclasses
import os
import warnings
from collections.abc import Mapping
from typing import Any

from inductor_ext.env import env_flag
from inductor_ext.inductor.passes import PASSES

ROUTES = ("auto", "kernel", "inductor")

SETTINGS: dict[str, tuple[str, str]] = {
    "route": (
        '"auto"',
        (
            '"kernel" (our Triton kernels), "inductor" (Inductor\'s code from the op\'s math) or "auto" (both timed '
            'at compile time, the faster kept); or per op family, {"rms_norm": "kernel", "default": "auto"} '
            '(environment: "auto,rms_norm=kernel")'
        ),
    ),
    "multi_kernel": (
        "1",
        (
            "Inductor's triton.multi_kernel (persistent and looped reductions, the faster kept at run time); "
            "TORCHINDUCTOR_MULTI_KERNEL or triton.multi_kernel wins; exports leave Inductor's setting"
        ),
    ),
    "assume_no_padding": (
        "false",
        (
            "promise that the 2-D integer inputs masks are built from (HF's attention_mask) hold no padding, so "
            "the mask can be proven causal; checked on the device, no host sync"
        ),
    ),
}
"""The options that are not passes: name -> (default, what it does)."""

OPTION_NAMES = (*SETTINGS, *(name for name, graph_pass in PASSES.items() if graph_pass.option))
"""Our options, each spelled ``fastops.<name>`` in ``options``."""

DEPRECATED_PASS_OPTIONS = ("causal_mask", "lazy_linear_outputs", "accumulate_products")
"""Exact passes that were options and now always run: the option (and its ``INDUCTOR_EXT_<NAME>`` variable)
is still honoured, with a ``FutureWarning``, until the next release removes it."""

RENAMED_OPTIONS = {"patterns": "rewrites"}
"""Old option name -> its name now (the pass's and its module's): the old option and its ``INDUCTOR_EXT_<OLD>``
variable still work, with a ``FutureWarning``, until the next release removes them."""

PASSES_OFF = "_passes_off"
"""For tests and benchmarks that measure a pass against its absence, not a user option: ``fastops._passes_off``,
the names of passes not to run, or in the environment ``INDUCTOR_EXT_PASSES_OFF``, a comma-separated list."""
PASSES_OFF_ENV = "INDUCTOR_EXT_PASSES_OFF"
_PREFIX = "fastops."


@dataclasses.dataclass(frozen=True)
class BackendOptions:
    default_route: str = "auto"
    routes: tuple[tuple[str, str], ...] = ()
    """Per-family overrides of ``default_route``, as sorted ``(family, route)`` pairs."""
    multi_kernel: int | None = 1
    """None: leave Inductor's own setting (``TORCHINDUCTOR_MULTI_KERNEL`` or an explicit option)."""
    cpp_wrapper: bool = False
    assume_no_padding: bool = False
    passes: tuple[str, ...] = tuple(sorted(name for name, graph_pass in PASSES.items() if graph_pass.default))
    """The passes that run (sorted: the compile caches' key holds this object's repr)."""

    def route_for(self, family: str) -> str:
        return dict(self.routes).get(family, self.default_route)

    def runs(self, name: str) -> bool:
        """Whether the pass ``name`` runs."""
        if name not in PASSES:
            raise KeyError(f"no graph pass named {name!r}; the passes: {list(PASSES)}")
        return name in self.passes

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
    (None: leave Inductor's setting, as exports do). ``cpp_wrapper`` (Inductor's option, or its
    process-wide config) also forces ``triton.autotune_at_compile_time`` on: torch 2.13 otherwise
    defaults it off and asserts with multi-kernel.
    """
    from torch._inductor import config as inductor_config

    if options is not None and not isinstance(options, Mapping):
        raise TypeError(
            f"fastops_inductor: options must be a dict of option name -> value, got {type(options).__name__}"
        )
    options = dict(options or {})
    ours = {k[len(_PREFIX) :]: options.pop(k) for k in list(options) if isinstance(k, str) and k.startswith(_PREFIX)}
    ours, env = _renamed_options(ours, env)
    unknown = set(ours) - set(OPTION_NAMES) - set(DEPRECATED_PASS_OPTIONS) - {PASSES_OFF}
    if unknown:
        known = ", ".join(_PREFIX + k for k in OPTION_NAMES)
        raise ValueError(f"fastops_inductor: unknown options {sorted(_PREFIX + k for k in unknown)}; known: {known}")

    route = ours.get("route", env.get("INDUCTOR_EXT_ROUTE", "auto"))
    default_route, routes = _parse_route(route)

    if "multi_kernel" in ours:
        multi_kernel: int | None = _multi_kernel(ours["multi_kernel"], "fastops.multi_kernel")
    elif "triton.multi_kernel" in options or "TORCHINDUCTOR_MULTI_KERNEL" in env:
        multi_kernel = None
    elif "INDUCTOR_EXT_MULTI_KERNEL" in env:
        multi_kernel = _multi_kernel(env["INDUCTOR_EXT_MULTI_KERNEL"], "INDUCTOR_EXT_MULTI_KERNEL")
    else:
        multi_kernel = default_multi_kernel
    cpp_wrapper = bool(options.pop("cpp_wrapper", inductor_config.cpp_wrapper))
    for name, value in ours.items():
        if (name == "assume_no_padding" or name in PASSES) and not isinstance(value, bool):
            raise TypeError(f"fastops_inductor: fastops.{name} must be True or False, got {value!r}")
    assume_no_padding = ours.get("assume_no_padding", env_flag(env, "INDUCTOR_EXT_ASSUME_NO_PADDING", False))
    for name in DEPRECATED_PASS_OPTIONS:
        if name in ours or PASSES[name].env_var in env:
            warnings.warn(
                f"fastops_inductor: fastops.{name} (and {PASSES[name].env_var}) is deprecated and goes in the next "
                "release: the pass is exact and always runs",
                FutureWarning,
                stacklevel=2,
            )
    off = {name.strip() for name in env.get(PASSES_OFF_ENV, "").split(",") if name.strip()}
    named_off = ours.get(PASSES_OFF, ())
    if isinstance(named_off, str) or not all(isinstance(name, str) for name in named_off):
        raise TypeError(f"fastops_inductor: fastops.{PASSES_OFF} must be a tuple of pass names, got {named_off!r}")
    off.update(named_off)
    if unknown_off := sorted(str(name) for name in off - set(PASSES)):
        raise ValueError(
            f"fastops_inductor: passes turned off that do not exist: {unknown_off}; the passes: {list(PASSES)}"
        )
    enabled = tuple(
        name
        for name, graph_pass in PASSES.items()
        if name not in off
        and (
            ours.get(name, env_flag(env, graph_pass.env_var, graph_pass.default))
            if graph_pass.option or name in DEPRECATED_PASS_OPTIONS
            else graph_pass.default
        )
    )
    enabled = tuple(sorted(enabled))
    return BackendOptions(default_route, routes, multi_kernel, cpp_wrapper, bool(assume_no_padding), enabled), options


def _renamed_options(ours: dict[str, Any], env: Mapping[str, str]) -> tuple[dict[str, Any], Mapping[str, str]]:
    """``ours`` and ``env`` with each old option name of :data:`RENAMED_OPTIONS` (and its variable) under its
    new name, with a ``FutureWarning``; the old and the new name together is an error."""

    def rename(given: Mapping[str, Any], old: str, new: str, shown: str) -> Mapping[str, Any]:
        """``given`` with its key ``old`` as ``new`` (``shown`` formats a key as the user spelled it); ``given``
        itself when it has no ``old``."""
        if old not in given:
            return given
        old_shown, new_shown = shown.format(old), shown.format(new)
        if new in given:
            raise ValueError(f"fastops_inductor: {old_shown} is the old name of {new_shown}; give only {new_shown}")
        warnings.warn(
            f"fastops_inductor: {old_shown} is renamed {new_shown}; the old name goes in the next release",
            FutureWarning,
            stacklevel=4,
        )
        return {**{key: value for key, value in given.items() if key != old}, new: given[old]}

    for old, new in RENAMED_OPTIONS.items():
        ours = dict(rename(ours, old, new, _PREFIX + "{}"))
        env = rename(env, f"INDUCTOR_EXT_{old.upper()}", PASSES[new].env_var, "{}")
    return ours, env


def options_table() -> str:
    """The options as a markdown table (docs/backend.md holds it between its options-table markers)."""
    rows = ["| option | environment | default | what it does, and why |", "|---|---|---|---|"]
    for name, (default, what) in SETTINGS.items():
        rows.append(f"| `fastops.{name}` | `INDUCTOR_EXT_{name.upper()}` | {default} | {what} |")
    for graph_pass in PASSES.values():
        option = f"`fastops.{graph_pass.name}`" if graph_pass.option else f"({graph_pass.name}: always runs)"
        env = f"`{graph_pass.env_var}`" if graph_pass.option else "—"
        stages = ", ".join(graph_pass.stages)
        default = str(graph_pass.default).lower()
        rows.append(f"| {option} | {env} | {default} | a graph pass ({stages}): {graph_pass.reason} |")
    return "\n".join(rows) + "\n"


def _multi_kernel(value: Any, name: str) -> int:
    """Inductor's ``triton.multi_kernel`` level (0 off, 1 on, 2 and 3 its variants) from an option or the environment."""
    level = value if isinstance(value, int) else int(value) if isinstance(value, str) and value.isdigit() else None
    if level is None or not 0 <= level <= 3:
        raise ValueError(
            f"fastops_inductor: {name} must be 0, 1, 2 or 3 (Inductor's triton.multi_kernel), got {value!r}"
        )
    return int(level)


def _families() -> set[str]:
    """The op families a route can name (registered by the op modules, imported here for that)."""
    import inductor_ext.ops  # noqa: F401
    from inductor_ext.library.registration import FAMILY_OF

    return set(FAMILY_OF.values())


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
    unknown = sorted(str(family) for family in set(entries) - _families() - {"default"})
    if unknown:
        raise ValueError(
            f"fastops_inductor: fastops.route names unknown op families {unknown}; known: "
            f"{', '.join(sorted(_families()))} and 'default'"
        )
    default = entries.pop("default", "auto")
    return default, tuple(sorted(entries.items()))


def _split_env_route(text: str) -> list[tuple[str, str]]:
    """``"auto,rms_norm=kernel"`` -> ``[("default", "auto"), ("rms_norm", "kernel")]``."""
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        family, sep, value = item.partition("=")
        pairs.append((family.strip(), value.strip()) if sep else ("default", family))
    return pairs
