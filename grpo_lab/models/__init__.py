"""The models a run holds: the 4-bit LoRA learner, the reference, optimizer offload, bitsandbytes' 4-bit path, model
shapes from config.json, where a model's files come from, and the built-in tiny models; and FSDP2 over them for a
sharded learner's ranks (fsdp.py: sharding, the generation context and `FSDP`, the executor contract's `Sharding`;
meta_load.py: loading without ever holding the model whole; failed_pass.py: a failed pass reset and agreed by every
rank)."""
