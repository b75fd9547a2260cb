"""The configuration's error type (a leaf, so every config module can raise it)."""


class ConfigError(ValueError):
    """A bad configuration; the message names the field."""
