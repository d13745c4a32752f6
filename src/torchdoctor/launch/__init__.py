"""`torchdoctor launch`: torchrun with every rank recorded (plan.py), its preflight checks and `bench scaling`."""
