"""Errors that mean "the user asked for something wrong": printed as one line, no traceback."""


class UserError(Exception):
    """Bad input from the user (config, paths, checkpoints): the CLI prints it and exits 2."""


class ConfigError(UserError):
    """A config file or override that does not parse or validate; the message names key and file."""
