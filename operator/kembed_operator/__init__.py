"""The kembed operator: runs EmbeddingService resources as kembed server Deployments.

Layout (the reconcile loop, read top to bottom): ``spec`` parses and checks a resource's spec,
``slo`` derives admission and autoscaling numbers from one latency objective, ``render`` turns a
spec into child manifests, ``status`` turns the children's state into conditions (those four are
pure), ``reconcile`` applies one render through the client it is given and writes the status,
``kube`` is the only module that talks to the API server (and only as ``permissions`` allows),
``kinds`` declares every kind it touches, and ``handlers`` runs one reconcile loop per resource
under kopf.
"""
