"""Phases on this process's models: the one-process executor (also the executor inside each rank of a sharded
learner)."""
