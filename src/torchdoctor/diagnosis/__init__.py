"""Diagnosis: rules over a recording that name the bottleneck and a measured fix."""
