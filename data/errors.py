"""The errors a user sees: the data pipeline's and every command's.

Every message names the file, field or setting at fault and the fix, so the CLI can print it
as is (``sinklm CMD: message``) without a traceback. They live here, at the bottom of the
dependency arrows (data -> models -> train, eval), so every package's command may raise them.
"""

from __future__ import annotations


class DataError(ValueError):
    """Bad input to the data pipeline: raised before any work is done where that is possible."""


class CommandError(Exception):
    """A refusal the user can act on. ``main`` prints ``sinklm COMMAND: message`` to stderr,
    with no traceback, and exits with ``code``: 2 for bad input, 1 where a service (the Hub,
    the network) failed."""

    def __init__(self, message: object, code: int = 2) -> None:
        super().__init__(str(message))
        self.code = code


def check_at_least(*limits: tuple[str, int | None, int]) -> None:
    """Refuse a numeric flag below its floor; each limit is (flag, value or None, floor)."""
    for flag, value, low in limits:
        if value is not None and value < low:
            raise CommandError(f"{flag} {value}: must be at least {low}")
