"""User-facing errors: the CLI prints their message on one line and exits with code 2."""


class BytedietError(Exception):
    """Base class of every error that is the user's input, not a bug."""


class CheckpointError(BytedietError):
    """A checkpoint is missing, corrupt, or of an unsupported kind."""


class ConfigError(BytedietError, ValueError):
    """A configuration value or a request field is invalid."""
