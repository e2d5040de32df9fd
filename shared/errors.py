"""The project's configuration error (a ValueError: the CLI prints it as one line)."""


class ConfigError(ValueError):
    """A configuration value is missing, unknown or of the wrong type/range."""
