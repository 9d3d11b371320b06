"""What a run keeps and gives back: the rollback snapshot, checkpoints, run directories, and failures on demand."""
