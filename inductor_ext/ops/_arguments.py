"""Argument checks the public functions share: a clear error that names the function and the argument."""

import numbers


def check_real(fn: str, name: str, value: object) -> None:
    """``TypeError`` unless ``value`` is a real number: an int or float (numpy's too), not a bool or a tensor."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{fn}: {name} must be a real number, got {value!r} ({type(value).__name__})")
