"""Rollout workers (rollouter.num_workers > 0): whole groups run in worker processes beside the
generators; the worker actor, the controller's link to one, and the pool."""
