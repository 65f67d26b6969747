"""Transport, both planes: the control plane (an embedded NATS server, connections to it, every subject name, the
msgpack codec, NATS micro services, session capabilities) and the data plane (the binary frame layout, the node HTTP
client and raw hop links, the HTTP server with its fast lane, the HTTP and NATS error edges, the tracker client,
liveness probes of a session's hops). ``gateway`` and ``actors`` share these and ``schemas``, never each other's
code."""
