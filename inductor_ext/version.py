"""The package version (one place; pyproject.toml and the caches read it)."""

__version__ = "0.1.0"
