"""Coordination: several jobs on one machine, distributed runs, hand-off to Slurm."""
