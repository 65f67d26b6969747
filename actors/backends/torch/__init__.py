"""The torch backend (the reference path): transformers decoder layers restricted to a node's range.

The modules import torch; import what you need from them (``backend.load_torch``).
"""
