"""What the server delivers: load against ``python -m kembed``, its start-up, its host path beside
a bare echo, priority classes, fair admission, hostile clients, corpus jobs, bulk clients, the
autoscaler's demand, and the peer (Infinity)."""
