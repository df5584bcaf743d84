"""The kembed operator: runs EmbeddingService resources as kembed server Deployments, and
EmbeddingJob resources as Indexed Jobs that embed a corpus with such a service.

Layout (the reconcile loop, read top to bottom): ``spec`` and ``job_spec`` parse and check a
resource's spec (and are the CRDs' schema source: ``crd`` generates ``crds/`` from them); ``trust``
decides what an author may choose (images, what pods are handed); ``slo`` derives admission and
autoscaling numbers from one latency objective; ``render`` and ``job_render`` turn a spec into child
manifests, ``access`` the TLS and NetworkPolicy parts of them; ``status`` and ``job_status`` turn the
children's state into conditions (those are pure); ``reconcile`` and ``job_reconcile`` apply one
render through the client they are given and write the status; ``kube`` is the only module that
talks to the API server (and only as ``permissions`` allows), ``kinds`` declares every kind it
touches, and ``handlers`` runs one reconcile loop per resource under kopf.
"""
