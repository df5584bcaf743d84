"""Autoscaling proven on a fleet: ``python -m bench.fleet`` (``run``); the pods, their modeled
device, the Service, the HPA's algorithm, the judge and the plot."""
