"""What can be wrong with a checkpoint, as exception types a caller can tell apart."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The directory, tag, ``latest`` pointer or manifest does not exist (a save that never
    finished leaves no manifest)."""


class CorruptCheckpointError(CheckpointError):
    """A file is truncated, fails its checksum, or does not parse."""


class IncompatibleCheckpointError(CheckpointError):
    """The checkpoint is intact but does not fit this model or optimizer."""
