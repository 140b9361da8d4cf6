"""User-facing errors: one line that names the file or value and the fix."""


class SpecrtError(Exception):
    """An error caused by the user's input or environment; the CLI prints it as one line and exits 1."""


def changes(old: dict, new: dict, keys=None) -> str:
    """`key old → new` for each of `keys` (by default every key of either, sorted) whose value differs: what a
    refusal of changed settings names. "" when none did."""
    keys = sorted({*old, *new}) if keys is None else keys
    return ", ".join(f"{k} {old.get(k)!r} → {new.get(k)!r}" for k in keys if old.get(k) != new.get(k))
