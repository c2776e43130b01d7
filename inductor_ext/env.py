"""Environment variables of the package (``INDUCTOR_EXT_*``), parsed one way everywhere."""

from collections.abc import Mapping


def env_flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    """The boolean environment variable ``name`` (0/1/true/false/yes/no/on/off), ``default`` when unset."""
    value = env.get(name)
    if value is None:
        return default
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{name} must be 0/1/true/false, got {value!r}")
