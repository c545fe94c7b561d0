"""Errors the data pipeline raises for bad user input (reported as one line by the CLI)."""


class DataError(Exception):
    """A problem with the user's data or data config: missing shards, bad spec, failure rate exceeded."""
