"""Checks of the config and the machine, each one line naming the field: devices, paths, what is installed, which GPUs
an engine sees and who may sit where (before anything loads), and the DataParallel guard (on a loaded learner, before
each step). A sharded learner's world (its ranks, FSDP2, Ray and its address) is checked by checks/world.py."""
