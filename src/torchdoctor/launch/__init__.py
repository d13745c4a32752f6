"""`torchdoctor launch`: torchrun with every rank recorded: the plan (plan.py), its preflight
checks (preflight.py), one node's launch (node.py) and `bench scaling` (scaling.py)."""
