"""The one exception posbench raises for anything a user can fix; the CLI prints it as one line."""


class PosbenchError(Exception):
    """A problem with the user's input or files, worded so the user can act on it."""
