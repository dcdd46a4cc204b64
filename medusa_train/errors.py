"""Errors a user can fix. The CLI prints them as one line on stderr and exits with code 2."""


class UserError(Exception):
    """Bad input or a missing prerequisite; the message says what to do."""


class ConfigError(UserError):
    """A configuration value is misspelt, has the wrong type, or contradicts another one."""


class DamagedArtefactError(UserError):
    """A file a stage reads (written by an earlier stage) is missing, truncated or of the wrong shape;
    the message names the file and the command that writes it again."""
