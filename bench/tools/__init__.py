"""The shared tools every benchmark room uses: the workload, the load generators, the server
launcher, Prometheus, the machine record, the report arithmetic, the echo and zero-cost servers.
They import no benchmark (``tests/bench/test_layout.py``)."""
