"""Sharded checkpoints of a ``ZeroEngine`` (``zero.checkpoint.state`` for now; split next)."""

from .state import *  # noqa: F403
