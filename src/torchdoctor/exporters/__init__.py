"""Hand-offs to the tools fleets already watch: Prometheus (and any OpenMetrics consumer),
Grafana, TensorBoard.

Everything here reads recordings (and, for the host-wide exporter, the machine through the
readers of :mod:`torchdoctor.sampling`); nothing in the core depends on this package.
"""
