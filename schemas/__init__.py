"""Wire models shared by every swarmroute actor.

This package is the bottom of the dependency graph: it imports nothing else of ours. Every model is versioned
(``schema_version``) and tolerant of unknown fields, so a newer peer can add fields without breaking an older one.
"""

from schemas.base import SCHEMA_VERSION, WireModel

__all__ = ["SCHEMA_VERSION", "WireModel"]
