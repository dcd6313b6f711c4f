"""The one exception type for bad configuration, raised before anything is spawned."""


class ConfigError(ValueError):
    """A bad config value, key or file. The message is one line and names the dotted key or file.

    The CLI prints it as ``error: <message>`` and exits with code 2 (no traceback).
    """
