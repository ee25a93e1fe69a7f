"""Typed errors. Every user mistake raises one of these with a message that says what is wrong and how to fix it.

All derive from ``ValueError`` so callers that only know the standard library still catch them; the CLI turns
them into a one-line message and exit code 2 instead of a traceback.
"""

from __future__ import annotations

__all__ = [
    "SecvflError",
    "ConfigError",
    "DataError",
    "MessageError",
    "ProtocolError",
    "UnsupportedError",
    "TrainingDiverged",
    "PartyIsolationError",
    "SecvflWarning",
    "DataWarning",
]


class SecvflError(ValueError):
    """Base class of every error secvfl raises on purpose."""


class ConfigError(SecvflError):
    """A flag, config file entry or argument is invalid or contradicts another."""


class TrainingDiverged(ConfigError):
    """Training met non-finite or exploding values (a step size too large for the data or the algorithm)."""


class DataError(SecvflError):
    """A dataset is missing, malformed, or does not fit the requested partitioning."""


class MessageError(SecvflError):
    """Bytes that claim to be a secvfl message are malformed, truncated or of an unknown kind."""


class ProtocolError(SecvflError):
    """A protocol layer refused a message (tampered, replayed, wrong key, dropped party...)."""


class UnsupportedError(ConfigError):
    """A valid option that cannot be combined with the chosen algorithm or another option."""


class PartyIsolationError(SecvflError):
    """Code tried to read another party's private state instead of going through the transport."""


class SecvflWarning(UserWarning):
    """Something was done on the user's behalf that they should know about; the CLI prints one line per warning."""


class DataWarning(SecvflWarning):
    """A dataset was usable only after a change (e.g. a column without values was dropped)."""
