"""Every patch inductor_ext makes to torch's internals, in one place, applied only while our code needs it.

Importing ``inductor_ext`` patches nothing. Each :class:`Patch` replaces one attribute for the
duration of an :func:`applied` block, which the ``fastops_inductor`` backend enters around its
compile (forward, and the backward AOTAutograd compiles lazily at the first ``.backward()``) and
``inductor_ext.export`` around AOTInductor's; stock ``torch.compile`` outside those blocks runs
torch's own code. Each patch names the torch versions it was tested on and the upstream issue it
works around; on any other version it is not applied, with one warning saying so (never patched blind).

The blocks nest and may run on several threads at once: a patch is installed when the first holder
takes it and removed when the last one lets go (a reference count under a lock). A stock
compile running on another thread *during* one of our compiles sees the patches too.

The patches themselves: :mod:`.torch_fixes` (torch bugs our defaults run into),
:mod:`.kernel_analysis_cache` (a memo on torch's per-launch Triton analysis, for compile time) and
:mod:`.vec_isa_probe` (no probe of the host's vector instructions for a graph without CPU tensors).
"""

import dataclasses
import functools
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from importlib import import_module, metadata
from typing import Any

Version = tuple[int, int]
"""``(major, minor)`` of a torch release."""


@dataclasses.dataclass(frozen=True)
class Patch:
    """One replaced attribute: ``target`` (``"module.path:Owner.attribute"``) becomes ``wrap(original)``
    while an :func:`applied` block lists the patch."""

    name: str
    target: str
    wrap: Callable[[Any], Any]
    tested: tuple[Version, Version]
    """First and last ``(major, minor)`` of torch the patch was checked on."""
    upstream: str
    """The upstream issue or pull request (or the code) the patch works around."""
    needed: Callable[[], bool] = lambda: True
    """False where torch does not need the patch (e.g. it has the upstream fix)."""

    def owner_and_attribute(self) -> tuple[Any, str] | None:
        """The object holding the attribute and its name; None if there is no such attribute."""
        module_name, _, path = self.target.partition(":")
        *owners, attribute = path.split(".")
        try:
            owner: Any = import_module(module_name)
        except ImportError:
            return None
        for name in owners:
            owner = getattr(owner, name, None)
            if owner is None:
                return None
        return (owner, attribute) if hasattr(owner, attribute) else None


@functools.cache
def package_version(package: str) -> Version:
    """``(major, minor)`` of an installed distribution."""
    major, minor = metadata.version(package).split(".")[:2]
    return int(major), int(minor)


_lock = threading.Lock()
_installed: dict[str, tuple[int, Any, str, Any]] = {}
"""Patch name -> (holders, owner, attribute name, the original attribute)."""
_warned: set[str] = set()


def applicable(patch: Patch) -> bool:
    """Whether ``patch`` is applied here: a tested version that needs it and has its target. Warns once
    per patch when the version is outside the tested range."""
    first, last = patch.tested
    version = package_version("torch")
    if not first <= version <= last:
        if patch.name not in _warned:
            _warned.add(patch.name)
            warnings.warn(
                f"inductor_ext: torch {metadata.version('torch')} is outside the versions the "
                f"patch {patch.name!r} was tested on ({first[0]}.{first[1]}-{last[0]}.{last[1]}), so it is not "
                f"applied ({patch.upstream})",
                RuntimeWarning,
                stacklevel=4,
            )
        return False
    return patch.needed() and patch.owner_and_attribute() is not None


def _acquire(patches: Sequence[Patch]) -> list[Patch]:
    """Install each applicable patch of ``patches`` (or count one more holder of it); returns those
    held, to give to :func:`_release`."""
    held = []
    with _lock:
        for patch in patches:
            if patch.name in _installed:
                count, *rest = _installed[patch.name]
                _installed[patch.name] = (count + 1, *rest)
            elif applicable(patch):
                found = patch.owner_and_attribute()
                assert found is not None
                owner, attribute = found
                original = getattr(owner, attribute)
                setattr(owner, attribute, patch.wrap(original))
                _installed[patch.name] = (1, owner, attribute, original)
            else:
                continue
            held.append(patch)
    return held


def _release(held: Sequence[Patch]) -> None:
    """Let go of patches :func:`_acquire` returned; the last holder's release restores the original."""
    with _lock:
        for patch in held:
            count, owner, attribute, original = _installed.pop(patch.name)
            if count > 1:
                _installed[patch.name] = (count - 1, owner, attribute, original)
            else:
                setattr(owner, attribute, original)


@contextmanager
def applied(patches: Sequence[Patch]) -> Iterator[None]:
    """Within the block, each applicable patch of ``patches`` is installed (module docstring)."""
    held = _acquire(patches)
    try:
        yield
    finally:
        _release(held)


def installed() -> list[str]:
    """Names of the patches installed right now (none outside :func:`applied` blocks)."""
    with _lock:
        return sorted(_installed)


def inductor_patches() -> list[Patch]:
    """The patches the backend's and export's compiles apply."""
    from inductor_ext._compat import kernel_analysis_cache, torch_fixes, vec_isa_probe

    return [*torch_fixes.PATCHES, *kernel_analysis_cache.patches(), *vec_isa_probe.patches()]
