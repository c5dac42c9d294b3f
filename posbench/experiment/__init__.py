"""Experiments on disk: run records, checkpoints, planning, execution and status, a module each."""
