"""Building blocks of a learner sharded with FSDP2: sharding the 4-bit LoRA model (fsdp.py), loading it without ever
holding it whole (meta_load.py), recovering a failed pass (recovery.py), and its state gathered whole (gathered.py).
The one-process path uses them too: each is the identity in a world of one."""
