"""The error of a bad configuration (its own module so that the small modules the schema
builds on, :mod:`dept_mega.variant`, can raise it without importing the schema)."""
from __future__ import annotations


class ConfigError(ValueError):
    """A bad configuration: the message names the key and the value."""
