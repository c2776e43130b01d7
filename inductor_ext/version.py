"""The package version (one place; setup.py and the caches read it)."""

__version__ = "0.1.0"
