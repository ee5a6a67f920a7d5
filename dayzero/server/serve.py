"""`dayzero serve`: take the port, load the model, build the app, run uvicorn until SIGINT/SIGTERM
(the first drains, a second SIGINT exits at once: `_server_class`).

The listening socket is bound before the model loads, so a busy port (or an address that cannot be
bound) fails in a second, not after the load. On SIGTERM uvicorn stops accepting connections and waits up to `GRACEFUL_SHUTDOWN_S` for in-flight
requests to finish; then the lifespan shutdown aborts whatever is left and joins the engine thread.
A failed rank of a tensor/expert-parallel job (dayzero.engine.tp_workers) stops the server the same way,
within RANK_FAILURE_EXIT_S, and `serve` returns 1; /health answers 503 naming the rank meanwhile.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

GRACEFUL_SHUTDOWN_S = 30
RANK_FAILURE_EXIT_S = 5  # after a rank's failure, the most the shutdown may take before the process exits
DEMO_SERVED_NAME = "demo"  # the API's model name for the demo checkpoint (`dayzero serve` without MODEL)


def serve(args: argparse.Namespace, model_dir: Path) -> int:
    import uvicorn

    from dayzero.engine_args import llm_kwargs, worker_node
    from dayzero.engine.llm import LLM
    from dayzero.server.app import ServerConfig, create_app

    engine_args = llm_kwargs(args)  # checks the engine flags
    if (code := worker_node(args)) is not None:  # not rank 0: this node only runs ranks
        return code
    if not 1 <= args.port <= 65535:
        raise ValueError(f"--port must be in [1, 65535], got {args.port}")
    if args.max_queued_requests < 0:
        raise ValueError(f"--max-queued-requests must be >= 0, got {args.max_queued_requests}")
    from dayzero.chat.formats import format_named

    for flag in (args.tool_call_parser, args.reasoning_parser):
        if flag is not None:
            format_named(flag)  # an unknown name fails before the load
    if not args.max_request_mib > 0:
        raise ValueError(f"--max-request-mib must be > 0, got {args.max_request_mib}")
    sock = bind(args.host, args.port)
    try:
        llm = LLM(model_dir, **engine_args, progress=True)
        pool = llm.scheduler.kv.pool
        print(f"[dayzero] loaded {model_dir}; context {llm.max_model_len} tokens, KV pool {pool.num_blocks} blocks "
              f"of {llm.scheduler.kv.block_size} tokens; {llm.startup.summary()}", file=sys.stderr)
        config = ServerConfig(
            served_model_name=args.served_model_name or model_dir.name, api_key=args.api_key,
            max_running_requests=args.max_running_requests, max_queued_requests=args.max_queued_requests,
            tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
            max_request_bytes=int(args.max_request_mib * 2**20),
            extra_info={"host": args.host, "port": args.port, "chunked_prefill_size": args.chunked_prefill_size,
                        "mem_fraction": args.mem_fraction, "kv_cache_gib": args.kv_cache_gib,
                        "kv_cache_dtype": args.kv_cache_dtype, "prefix_caching": not args.disable_prefix_caching,
                        "device": args.device,
                        "dtype": args.dtype})
        app = create_app(llm, config)
        server = _server_class()(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
        if llm.workers is not None:
            llm.workers.on_failure.append(lambda failure: _exit_on_rank_failure(server, failure))
        server.run(sockets=[sock])
        failed = llm.workers is not None and llm.workers.failure is not None
        llm.close()
    finally:
        sock.close()
    return 1 if failed else 0


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server with dayzero's signals: the first SIGINT or SIGTERM drains (stop accepting, let
        in-flight requests finish for up to GRACEFUL_SHUTDOWN_S, abort the rest, return: exit code 0); a
        second SIGINT exits at once (code 130), cutting what is in flight. Unlike uvicorn's own, the
        signals are not raised again once the server has stopped (that would end a drained server with a
        KeyboardInterrupt)."""

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig, frame) -> None:
            if self.should_exit and sig == signal.SIGINT:
                print("[dayzero] second SIGINT: exiting now, requests in flight are cut", file=sys.stderr, flush=True)
                os._exit(130)
            if not self.should_exit:
                print(f"[dayzero] {signal.Signals(sig).name}: draining (no new connections; requests in flight finish "
                      f"within {GRACEFUL_SHUTDOWN_S} s; a second SIGINT exits at once)", file=sys.stderr, flush=True)
            self.should_exit = True

    return Server


def _exit_on_rank_failure(server, failure: str) -> None:
    """A rank died: say so, stop serving (in-flight requests end with the error) and exit with 1, at once
    if the shutdown does not finish within RANK_FAILURE_EXIT_S."""
    print(f"[dayzero] a rank of the tensor/expert-parallel job failed: {failure}; the server exits", file=sys.stderr,
          flush=True)
    server.should_exit = True

    def force():
        time.sleep(RANK_FAILURE_EXIT_S)
        print("[dayzero] the shutdown did not finish in time; exiting", file=sys.stderr, flush=True)
        os._exit(1)
    threading.Thread(target=force, name="dayzero-exit", daemon=True).start()


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (what uvicorn then listens on); ValueError naming the address
    when it cannot be had (in use, or not an address of this machine)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as exc:
        raise ValueError(f"--host {host!r} is not an address this machine can bind: {exc.strerror}") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a closed server's port is reusable
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror} (is another server on --port {port}? "
                         "stop it or choose another port)") from None
    return sock
