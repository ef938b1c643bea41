"""Pricing: seconds and bytes of every strategy and edge (cost model, calibration, memory, resharding)."""
