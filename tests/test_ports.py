"""The suite's guard on the default ports (tests/conftest.py) holds: a server on one fails."""

from __future__ import annotations

import pytest

from kembed.contract import ANY_ADDRESS
from kembed.plumbing import listen
from tests.conftest import DEFAULT_PORTS


@pytest.mark.parametrize("port", DEFAULT_PORTS)
@pytest.mark.parametrize("host", ["127.0.0.1", ANY_ADDRESS])
@pytest.mark.parametrize("reuse_port", [True, False], ids=["API port", "health port"])
def test_a_server_on_a_default_port_cannot_bind_it(
    default_ports_held: list[int], port: int, host: str, reuse_port: bool
):
    """Bound as the supervisor and the front ends bind it (SO_REUSEPORT for gRPC and REST,
    SO_REUSEADDR for health): refused."""
    if port not in default_ports_held:
        pytest.skip(f"port {port} is another process's: this session could not hold it")
    with pytest.raises(OSError, match="Address already in use"):
        listen.bind(host, port, "test", "", reuse_port=reuse_port).close()
