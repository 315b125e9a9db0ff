"""Runbooks as Temporal workflows: what happens, in order. Deterministic, no I/O.

The list the worker registers is `workflows.registry.WORKFLOWS`.
"""
