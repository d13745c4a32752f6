"""Measurements of the fabric: collective bandwidth (allreduce.py)."""
