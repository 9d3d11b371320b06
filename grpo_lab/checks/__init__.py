"""Checks that run before anything is loaded: devices, paths, what is installed, the DataParallel guard, which GPUs an
engine sees, who may sit where, and a sharded world's ranks. Pure: they read the config and the machine, load
nothing."""
