"""``python -m bench.fleet``: the fleet benchmark (``bench.fleet.run``)."""

from bench.fleet.run import main

main()
