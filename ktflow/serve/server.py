"""Putting a server together and running it: `build` makes the engine and the app for a compiled
model and its tokenizer; `run` serves them with uvicorn until SIGTERM or Ctrl-C.

Shutdown: on SIGTERM (or the first Ctrl-C) the engine stops admitting (new requests get 503),
uvicorn stops accepting connections and waits up to `shutdown_timeout` seconds for the requests
in flight to finish, then cancels what is left; `run` returns normally after SIGTERM (so
`ktflow serve` exits 0) and raises KeyboardInterrupt after Ctrl-C (exit 130).
"""

from __future__ import annotations

import asyncio
import faulthandler
import io
import logging
import signal
import socket
import sys
from dataclasses import dataclass

from ..errors import ResourceError
from .app import DEFAULT_MAX_BODY_BYTES, ServeApp
from .engine import STEP_TIMEOUT_S, Engine
from .metrics import ServerMetrics
from .grammar import Grammars
from .runner import Runner, PoolRunner
from .tokenizer import ServeTokenizer
from .tool_parsers import parser_for

log = logging.getLogger("ktflow.serve")


@dataclass
class Served:
    """What `build` made: the engine (not started), the app and its Starlette application."""
    engine: Engine
    app: ServeApp

    @property
    def asgi(self):
        return self.app.starlette()


def build(compiled, tokenizer: ServeTokenizer, model_name: str, *, max_batch: int = 4, max_queue: int = 64,
          api_key: str | None = None, prefill_tokens: int | None = None, runner: Runner | None = None,
          max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, tool_parser: str | None = None,
          reasoning_parser: str | None = None, step_timeout: float = STEP_TIMEOUT_S,
          prefix_cache: bool = True, request_timeout_s: float = 30.0) -> Served:
    """An engine over `runner` (default: a PoolRunner with `max_batch` slots, reusing cached prompt
    prefixes unless `prefix_cache` is off, warmed: every slot's KV cache and every batch bucket's
    step made now) and the app."""
    eos = tokenizer.eos_ids | set(compiled.model.eos_ids if compiled.model is not None else ())
    if getattr(compiled, "draft", None) is not None:
        log.warning("the plan speculates with the model's MTP layer (speculate k=%d), but the serving engine's batched "
                    "steps decode without it: `ktflow run` and ktflow.generate use it", compiled.plans.speculation.k)
    grammars = Grammars(tokenizer, compiled.vocab_size, eos)
    grammars.warm()  # llguidance's tokenizer made before serving: no request waits for it
    if runner is None:
        runner = PoolRunner(compiled, max_batch, prefix_cache=prefix_cache)
        runner.warm()
    pool_runner = getattr(runner, "inner", runner)  # (a RanksRunner's own)
    if isinstance(pool_runner, PoolRunner) and pool_runner.grammars is None:
        pool_runner.grammars = grammars
    step = min(prefill_tokens or 256, compiled.chunk_tokens)  # one iteration's chunks are one prefill step
    engine = Engine(runner, tokenizer.decode, eos_ids=eos, max_queue=max_queue, prefill_tokens=step,
                    step_timeout=step_timeout)
    metrics = ServerMetrics(engine.stats)
    engine.metrics = metrics
    app = ServeApp(engine, tokenizer, model_name, api_key=api_key, metrics=metrics, vocab_size=compiled.vocab_size,
                   max_body_bytes=max_body_bytes,
                   sampling_defaults=compiled.model.generation.sampling if compiled.model is not None else None,
                   model_type=compiled.plans.model.model_type,
                   tool_parser=parser_for(compiled.plans.model.model_type, tool_parser),
                   reasoning=reasoning_parser == "think", body_timeout_s=request_timeout_s, grammars=grammars)
    return Served(engine, app)


def _log_requests(out) -> None:
    """The engine's one line a request (logger ktflow.serve), printed as the server's other lines
    are, unless the application configured that logger itself."""
    import logging

    logger = logging.getLogger("ktflow.serve")
    if logger.handlers:
        return

    class ToOut(logging.Handler):
        def emit(self, record):
            out(record.getMessage(), flush=True)

    logger.addHandler(ToOut())
    logger.setLevel(logging.INFO)
    logger.propagate = False


def header_deadline(seconds: float):
    """uvicorn's HTTP/1.1 protocol (h11) with a deadline on each request's headers: a connection
    that has not sent a whole request line and headers `seconds` after it opened, or after the
    first byte of its next request, gets 408 and is closed (an idle or trickling client holds no
    connection for long)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadline(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._deadline is None and self.conn.their_state is h11.IDLE:
                self._arm()  # a keep-alive connection's next request begins
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._disarm()  # its headers are in

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._deadline = self.loop.call_later(seconds, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                self.transport.close()

    return HeaderDeadline


def _stacks_on_sigusr1() -> bool:
    """`kill -USR1 <pid>` prints every thread's stack to stderr (a stall's diagnosis; the server
    goes on); False where it cannot be had (no SIGUSR1, or a stderr without a file descriptor)."""
    if not hasattr(signal, "SIGUSR1"):
        return False
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    except (AttributeError, ValueError, OSError, RuntimeError, io.UnsupportedOperation):
        return False
    return True


def run(served: Served, host: str, port: int, *, shutdown_timeout: float = 30.0, max_connections: int = 512,
        keep_alive_s: float = 5.0, request_timeout_s: float = 30.0, log=print) -> None:
    """Serve until SIGTERM (returns) or Ctrl-C (KeyboardInterrupt), draining as the module says.
    At most `max_connections` connections are served at once (more get 503), an idle keep-alive
    connection closes after `keep_alive_s`, a request's headers must arrive within
    `request_timeout_s` (`header_deadline`; its body too: the app's 408), and the process's soft
    limit on open files is raised to its hard limit."""
    import resource

    import uvicorn

    _log_requests(log)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            pass  # the limit stays; max_connections still bounds the connections

    engine = served.engine

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            engine.drain()
            super().handle_exit(sig, frame)

    try:  # bound here, so a port in use is one clear error rather than uvicorn's log and exit
        sock = socket.create_server((host, port), backlog=2048)
    except OSError as e:
        raise ResourceError(f"cannot listen on {host}:{port}: {e.strerror or e}; pick another --port (or --host)") from None
    port = sock.getsockname()[1]
    config = uvicorn.Config(served.asgi, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=shutdown_timeout, lifespan="on",
                            limit_concurrency=max_connections, timeout_keep_alive=keep_alive_s,
                            http=header_deadline(request_timeout_s))
    server = _Server(config)
    terminated = []
    # uvicorn raises the signal it caught again once it has shut down; a handler of our own takes
    # SIGTERM's so the process ends with status 0 rather than being killed by it
    previous = signal.signal(signal.SIGTERM, lambda sig, frame: terminated.append(sig))
    stacks = _stacks_on_sigusr1()
    try:
        engine.start()
        log(f"serving {served.app.model_name} on http://{host}:{port}/v1 ({engine.slots} slots, queue "
            f"{engine.max_queue}{', API key required' if served.app.api_key else ''}); SIGTERM or Ctrl-C stops",
            flush=True)
        server.run(sockets=[sock])
    finally:
        engine.stop(timeout=0.0)
        signal.signal(signal.SIGTERM, previous)
        if stacks:
            faulthandler.unregister(signal.SIGUSR1)
        sock.close()
    log("stopped", flush=True)
