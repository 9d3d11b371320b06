"""The models a run holds: the 4-bit LoRA learner, the reference, optimizer offload, bitsandbytes' 4-bit path, model
shapes from config.json, where a model's files come from, and the built-in tiny models."""
