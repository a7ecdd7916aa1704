"""Preemption handling: a checkpoint saved at the same step on every worker, an exit, a resume there."""
