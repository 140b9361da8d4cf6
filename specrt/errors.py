"""User-facing errors: one line that names the file or value and the fix."""


class SpecrtError(Exception):
    """An error caused by the user's input or environment; the CLI prints it as one line and exits 1."""
