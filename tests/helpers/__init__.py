"""What several test files share: eager reference training and its comparison (exactness), the
grid modes' training settings, saved-activation probes, the checkpointing, sequence-parallel and
pipeline x sequence-parallel cases, and random ILP problems. Imported as ``helpers.<module>``
(pyproject.toml puts tests/ on the path)."""
