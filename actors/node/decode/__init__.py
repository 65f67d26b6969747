"""The head's decode strategies (``actors.node.head_port.DecodeStrategy``), one per way a session decodes: ``relay``
(plain decoding on several hops), ``local_chain`` (head and tail on one node), ``rounds`` (n > 1); the verify
windows are ``actors.node.speculation.verify_loop``."""
