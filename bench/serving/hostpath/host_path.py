"""Part ``host_path``: kembed's zero-cost server beside the bare gRPC echo with the same process
count; part ``rest``: REST against gRPC on the zero-cost server, and kembed against the peer
(Infinity) over REST on the real model."""

from __future__ import annotations

from typing import Any

from bench.serving import peers
from bench.serving.hostpath.measure import (
    ZERO_COST,
    Options,
    calls_text,
    counter_figures,
    encode,
    frontends_setting,
    grpc_closed_loop,
    log_file,
    one_text_bodies,
    rest_closed_loop,
)
from bench.tools.server import echo_running, running


def host_path(opts: Options, short_texts: list[str]) -> list[dict[str, Any]]:
    """Echo with N processes, then the zero-cost server with N front ends, for each N."""
    requests = encode(short_texts, 1)
    pairs = []
    for n in opts.frontends:
        with echo_running(n, log_file(f"echo_{n}")) as echo:
            echo_figures = grpc_closed_loop(echo, requests, opts)
        with running(frontends_setting(n), log_file(f"zero_cost_{n}"), module=ZERO_COST) as server:
            server_figures = grpc_closed_loop(server, requests, opts)
        pairs.append({"processes": n, "echo": echo_figures, "zero_cost": server_figures})
        echo_calls, zero_cost_calls = calls_text(echo_figures), calls_text(server_figures)
        print(f"  host path, {n} process(es): echo {echo_calls}, zero-cost {zero_cost_calls} calls/s")
    return pairs


def rest(opts: Options, short_texts: list[str]) -> dict[str, Any]:
    """gRPC, then REST, against one zero-cost server with one front end; then the peer comparison."""
    settings = frontends_setting(1)
    with running(settings, log_file("rest_zero_cost"), module=ZERO_COST) as server:
        grpc_figures = grpc_closed_loop(server, encode(short_texts, 1), opts)
        rest_figures = rest_closed_loop(server, one_text_bodies(short_texts, server), opts, opts.duration)
    grpc_calls, rest_calls = calls_text(grpc_figures), calls_text(rest_figures)
    print(f"  REST, zero-cost server, 1 front end: gRPC {grpc_calls}, REST {rest_calls} calls/s")
    host = {"settings": settings, "grpc": grpc_figures, "rest": rest_figures}
    return {"host_path": host, "peer": rest_peer(opts, short_texts)}


def rest_peer(opts: Options, short_texts: list[str]) -> dict[str, Any]:
    """Infinity, then kembed with the real model (what a pod runs), each under the same REST load;
    without Infinity's venv, why it was skipped and the command that sets it up."""
    if not peers.installed(opts.peer_venv):
        command = peers.setup_command(opts.peer_venv)
        print(f"  REST peer: skipped, no Infinity in {opts.peer_venv}; set it up with: {command}")
        return {"skipped": f"no Infinity in {opts.peer_venv}", "setup_command": command}
    exe = peers.setup(opts.peer_venv)  # installs nothing here: it checks the venv's torch is the CPU one
    with peers.infinity_running(exe, log_file("rest_infinity"), dtype=opts.peer_dtype) as server:
        infinity = rest_closed_loop(server, one_text_bodies(short_texts, server, peers.MODEL_NAME), opts,
                                     opts.peer_duration)  # fmt: skip
    settings = {**frontends_setting("auto"), "dtype": opts.peer_dtype}
    with running(settings, log_file("rest_kembed"), module="kembed") as server:
        before = server.metrics()
        kembed = rest_closed_loop(server, one_text_bodies(short_texts, server), opts, opts.peer_duration)
        kembed.update(counter_figures(before, server.metrics(), kembed["span_s"]), **server.served())
    infinity["dtype"] = peers.infinity_dtype(opts.peer_dtype)
    worker = kembed["worker"]
    print(f"  REST, real model: Infinity {calls_text(infinity)}, kembed {calls_text(kembed)} calls/s "
          f"(kembed's worker busy "
          f"{worker['busy_share']:.0%}, padding {kembed['padding_ratio']:.0%}, {worker['rows_per_batch']:.1f} rows "
          "a batch)")  # fmt: skip
    return {"peer": peers.PEER, "settings": settings, "infinity": infinity, "kembed": kembed}
