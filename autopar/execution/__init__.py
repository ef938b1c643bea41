"""Execution set-up: compile a plan into a training object (weights, placement, micro-batches, step checks)."""
