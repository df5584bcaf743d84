"""``python -m bench.serving.hostpath``: the host path run (``bench.serving.hostpath.run``)."""

from bench.serving.hostpath.run import main

main()
