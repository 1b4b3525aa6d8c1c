"""Tracing: a model and an example batch -> the aten-level op graph (`OpGraph`) with FLOPs, bytes,
saved activations and repeated blocks.
"""
