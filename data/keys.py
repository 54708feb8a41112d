"""A config mapping's keys checked against the dataclass it builds.

``cls(**data)`` would answer a misspelt key with a bare TypeError; this names every unknown key
and the allowed ones, in the caller's own error type, before anything is built.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import fields
from typing import Any


def reject_unknown_keys(
    data: Mapping[str, Any], spec: type, what: str, error: type[Exception],
    hidden: Collection[str] = (),
) -> None:
    """Raise ``error`` if ``data`` has keys that are not fields of the dataclass ``spec``.

    ``what`` names the keys in the message (``source keys``); ``hidden`` fields are accepted but
    not offered, such as a key that only selects which dataclass to build.
    """
    known = {field.name for field in fields(spec)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise error(f"unknown {what} {unknown}; allowed {sorted(known - set(hidden))}")
