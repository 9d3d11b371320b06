"""Recovery: all-or-nothing steps (the rollback snapshot), checkpoints a run resumes from, run directories, and
failures on demand to show it working."""
