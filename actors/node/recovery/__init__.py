"""Surviving the loss of a node (issue #18): what each hop keeps (``record``: tokens and the ``journal`` of frames
sent downstream), its KV ``snapshots`` handed to a standby holder, what a holder keeps (``snapshot_store``) and
serves (``standby``), and the head's ``repair`` of its route."""
