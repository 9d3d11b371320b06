"""A learner sharded with FSDP2 over `placement.learner_procs` processes (ranks), driven phase by phase from one Lab.

The model under FSDP2 lives with the models (models/fsdp.py, meta_load.py, failed_pass.py: the identity in a world of
one); here: gathered.py (its state gathered whole). Its world is checked before any process starts with the other
checks (checks/world.py).

The Ray driver, which nothing in the one-process path imports (the Lab reaches `RankExecutor` by name,
execution/contract.py): driver.py (`RankExecutor`, the Lab's executor in the notebook's process), ranks.py (the ranks
as Ray actors, every call's reply and memory samples collected, a dead rank's restart), ray_cluster.py (the Ray they run
on and their placement group), wire.py (one-line errors and memory deltas, shared by both sides), remote.py (the
driver's vLLM engine as the ranks' generator). A rank's actor runs grpo_lab/rank.py, an entry point above the Lab (it
runs a one-process Lab of its own over its shard), which ranks.py names by import path.
Which rank a process is: grpo_lab/runtime.py.
"""
