"""The engine's one error for settings a person must change."""


class ConfigError(ValueError):
    """A configuration value is invalid; the message says which and why."""
