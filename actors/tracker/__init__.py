"""The tracker actor: watches the node registry and answers route requests."""

from actors.tracker.actor import Tracker

__all__ = ["Tracker"]
