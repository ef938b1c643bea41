"""What several test files share: eager reference training and its comparison (exactness), the
grid modes' training settings, saved-activation probes, the checkpointing, sequence-parallel and
pipeline x sequence-parallel cases, random ILP problems, and the large-batch optimizer tests' ramped
Llama (large_batch). Imported as ``helpers.<module>``
(pyproject.toml puts tests/ on the path)."""
