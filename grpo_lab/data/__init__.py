"""A run's data: the dataset a TRL user brings (data/sources.py), the built-in arithmetic set (data/arithmetic.py) and
the prompt source that serves it in a seeded, resumable order (data/prompts.py). The executor and the planner read it;
it stands above the algorithm's containers and below everything that runs a step."""
