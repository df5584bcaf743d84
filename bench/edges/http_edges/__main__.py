"""``python -m bench.edges.http_edges``: one candidate stack's server process."""

from bench.edges.http_edges.process import main

main()
