"""One exception type for every error a user can cause; CLI and server turn it into a message."""


class MtpllmError(Exception):
    """A problem with user input or files, reported as a clear message (never a traceback)."""
