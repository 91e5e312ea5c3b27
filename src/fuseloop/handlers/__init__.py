"""Handlers users attach to a Loop: log, validate, monitors, checkpoints, progress, writers."""
