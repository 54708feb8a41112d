"""The data pipeline's error: bad input, raised before any work is done where possible."""

from __future__ import annotations

from sinklm.cli.main import UserError


class DataError(UserError, ValueError):
    """Bad input to the data pipeline; the message names the file or field and the fix."""
