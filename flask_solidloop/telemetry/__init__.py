"""Telemetry: what the package reports about itself to the host's observability stack.

This subpackage owns the *emitting* side of tracing and metrics: span and
instrument helpers that the layers above call at their transitions and turn
bodies. It sits at the bottom of the layer order (it imports only ``config``
and ``errors`` of ours), so any layer may call it; anything that must read our
tables to report a figure lives in the layer that owns those tables.
"""
