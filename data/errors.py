"""The one exception type of the data pipeline.

Every message names the file, field or setting at fault and the fix, so the CLI can print it
as is (``sinklm CMD: message``) without a traceback.
"""

from __future__ import annotations


class DataError(ValueError):
    """Bad input to the data pipeline: raised before any work is done where that is possible."""
