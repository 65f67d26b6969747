"""swarmroute's command line: the composition root that wires actors, gateway, bus and artifacts together."""

__version__ = "0.1.0"
