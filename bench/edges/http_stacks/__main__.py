"""``python -m bench.edges.http_stacks``: which HTTP stack for the REST edge."""

from bench.edges.http_stacks.run import main

main()
