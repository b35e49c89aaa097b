"""`scripts/serve.py` / `python -m jaxcb.server`: flags → engine → app → uvicorn.

Every engine config field is a flag of its own, generated from the config dataclasses
(`--max-num-seqs 64`, `--page-size 16`, `--token-buckets 16 32 64`), applied over the YAML
preset given with `--config`. The server binds its socket before building the engine, so a
busy port fails fast and `--port 0` picks a free port (the startup log prints the URL).

SIGINT/SIGTERM drain: the server keeps accepting connections and answers new requests 503,
running ones get `--shutdown-timeout` seconds to finish and are aborted after that; then it
stops listening and the process exits 0. A second signal quits at once, in one log line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import ipaddress
import logging
import signal
import socket
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType

import jax
import uvicorn

from jaxcb.build import build_engine
from jaxcb.cli import add_engine_args, engine_config_from_args
from jaxcb.engine.interface import Engine
from jaxcb.runtime.setup import model_name
from jaxcb.server.app import ServerSettings, build_app
from jaxcb.server.engine_loop import EngineLoop
from jaxcb.server.lora_adapters import parse_lora_modules
from jaxcb.server.prompts import read_chat_template
from jaxcb.server.tool_parsers import PARSERS

logger = logging.getLogger("jaxcb.server")

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="serve.py",
        description="jaxcb OpenAI-compatible server (/v1/completions, /v1/chat/completions).",
    )
    server = parser.add_argument_group("server")
    server.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: %(default)s)"
    )
    server.add_argument(
        "--port", type=int, default=8000, help="port (default: %(default)s; 0: any free port)"
    )
    server.add_argument(
        "--api-key", help="require 'Authorization: Bearer <key>' on every /v1 route"
    )
    server.add_argument(
        "--served-model-name",
        nargs="+",
        help="model name(s) clients must send; default: --model, or the built-in model's name",
    )
    server.add_argument(
        "--show-model-path",
        action="store_true",
        help="/v1/models shows the model's path on disk in 'root' (default: the served name)",
    )
    server.add_argument(
        "--log-level", choices=LOG_LEVELS, default="info", help="(default: %(default)s)"
    )
    server.add_argument(
        "--max-request-body-mb",
        type=float,
        default=ServerSettings.max_request_body_bytes / 2**20,
        help="larger request bodies get 413 (MiB; default: %(default)s)",
    )
    server.add_argument(
        "--shutdown-timeout",
        type=float,
        default=ServerSettings.shutdown_timeout,
        help="seconds running requests get to finish on SIGINT/SIGTERM before they are aborted "
        "(default: %(default)s)",
    )
    server.add_argument(
        "--step-trace",
        type=Path,
        metavar="PATH",
        help="keep every engine step's record and write them on shutdown as a step trace "
        "(JSON; `python -m jaxcb.bench plot_trace` draws it, the ITL controller's budget "
        "included)",
    )
    server.add_argument(
        "--chat-template",
        metavar="FILE_OR_TEXT",
        help="a Jinja chat template (a file, or the template itself) used instead of the "
        "tokenizer's, for every chat request (as vLLM's --chat-template)",
    )
    server.add_argument(
        "--tool-call-parser",
        choices=sorted(PARSERS),
        default="hermes",
        help="how tool_choice auto finds the calls in the model's output: hermes, "
        '<tool_call>{"name": ..., "arguments": ...}</tool_call> blocks (Hermes, Qwen, '
        'SmolLM); llama3_json, {"name": ..., "parameters": ...} objects at the start of the '
        "output, separated by ';' (Llama 3.1 / 3.2) (default: %(default)s)",
    )
    server.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) to serve from start-up, each under the name a "
        "request's `model` gives (needs --enable-lora; as vLLM's --lora-modules)",
    )
    server.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="add POST /v1/load_lora_adapter {lora_name, lora_path} and "
        "/v1/unload_lora_adapter {lora_name} (behind --api-key): adapters loaded while "
        "serving (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)",
    )
    add_engine_args(parser, taken=set(vars(parser.parse_args([]))))
    return parser


# ---- running ----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("uvicorn.error").addFilter(_QuietCancellation())
    if args.log_level != "debug":  # jax's INFO lines are its internals (cache resets, probes)
        logging.getLogger("jax").setLevel(
            max(logging.WARNING, logging.getLevelName(args.log_level.upper()))
        )
    if args.shutdown_timeout < 0:
        parser.error(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if not args.max_request_body_mb > 0:
        parser.error(f"--max-request-body-mb must be > 0, got {args.max_request_body_mb}")
    try:
        config = engine_config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    if config.compile_in_background is None:  # the server answers once one bucket is compiled
        config = config.replace(compile_in_background=True)
    try:
        settings = ServerSettings(
            served_model_names=tuple(args.served_model_name or [model_name(config)]),
            api_key=args.api_key,
            shutdown_timeout=args.shutdown_timeout,
            max_request_body_bytes=int(args.max_request_body_mb * 2**20),
            show_model_path=args.show_model_path,
            step_trace=args.step_trace,
            chat_template=read_chat_template(args.chat_template),
            tool_call_parser=args.tool_call_parser,
            lora_modules=tuple(parse_lora_modules(args.lora_modules)),
            allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        )
    except ValueError as exc:
        parser.exit(2, f"serve.py: error: {exc}\n")
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        parser.exit(1, f"serve.py: cannot listen on {args.host}:{args.port}: {exc}\n")

    try:
        engine = build_engine(config, compile_progress=sys.stderr.isatty())
    except ValueError as exc:  # a config the model or the scheduler cannot take
        sock.close()
        parser.exit(2, f"serve.py: error: {exc}\n")
    if jax.process_count() > 1:  # each process would take its own requests and fall out of step
        sock.close()
        parser.exit(
            2,
            f"serve.py: error: the server runs in one process, not {jax.process_count()} "
            "(distributed): use batch_infer.py or LLM.generate across processes\n",
        )
    try:
        app = build_app(engine, settings)
    except ValueError as exc:  # the server cannot serve what it offers (a chat template)
        sock.close()
        parser.exit(2, f"serve.py: error: {exc}\n")
    url = server_url(args.host, sock.getsockname()[1])
    frozen = freeze_startup_heap()
    log_startup(engine, settings, url, frozen)
    warning = exposure_warning(sock.getsockname()[0], settings.api_key)
    if warning:
        logger.warning(warning)
    uv_config = uvicorn.Config(
        app,
        log_config=None,  # our logging format for uvicorn's loggers too
        log_level=args.log_level,
        lifespan="on",
        backlog=BACKLOG,
        timeout_graceful_shutdown=args.shutdown_timeout + 5,  # backstop behind our drain
    )
    _Server(uv_config, app.state.engine_loop, settings.shutdown_timeout).run(sockets=[sock])
    logger.info("server stopped")
    return 0


#: Connections the kernel queues before the server accepts them (uvicorn's default).
BACKLOG = 2048


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound and listening: a client that connects as soon as the start-up log
    names the URL waits in the backlog until uvicorn accepts, instead of being refused in
    the ~0.1 s before uvicorn starts (the CI's chat check once was)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def server_url(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else "[::1]" if host == "::" else host
    if ":" in shown and not shown.startswith("["):
        shown = f"[{shown}]"
    return f"http://{shown}:{port}"


def exposure_warning(address: str, api_key: str | None) -> str | None:
    """What to warn about when the server listens beyond this machine without an API key."""
    if api_key is not None:
        return None
    try:
        if ipaddress.ip_address(address.partition("%")[0]).is_loopback:
            return None
    except ValueError:  # not an IP address: no guess
        pass
    return (
        f"listening on {address} without --api-key: anyone who can reach this address can "
        "use the server; give --api-key KEY, or --host 127.0.0.1 to serve this machine only"
    )


def freeze_startup_heap() -> int:
    """Collect once, then move every object alive now (jax, transformers, the engine and the
    app: ~600k objects on bench-57m) out of the cyclic collector's view; returns how many.

    They live as long as the server. Left in the oldest generation, each full collection
    walks them all: 250-330 ms here, a stall of every running request (bench-57m bf16 at
    2 req/s: p99 TTFT 142-264 ms against a mean of 33-37). Refcounting still frees them."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def log_startup(engine: Engine, settings: ServerSettings, url: str, frozen: int = 0) -> None:
    config, info = engine.config, engine.info
    sched = config.scheduler
    tokens = info.num_pages * info.page_size
    model = info.model_path + (" (built-in, RANDOM WEIGHTS)" if info.random_weights else "")
    auth = ' -H "Authorization: Bearer $API_KEY"' if settings.api_key else ""
    name = settings.served_model_names[0]
    curl = (
        f"curl {url}/v1/completions -H 'Content-Type: application/json'{auth} "
        f'-d \'{{"model": "{name}", "prompt": "Hello", "max_tokens": 16}}\''
    )
    lines = [
        "jaxcb server ready",
        f"  model:        {model}, served as {', '.join(settings.served_model_names)}",
        f"  architecture: {info.architecture}, dtype {config.dtype}, "
        f"attention {info.attention_backend}, matmul {info.matmul_backend}, "
        f"max_model_len {info.max_model_len}",
        *([f"  CPU:          {_cpu_line(info.cpu_kernels)}"] if info.cpu_kernels else []),
        f"  parallel:     tensor_parallel_size {config.parallel.tensor_parallel_size}, "
        f"data_parallel_size {config.parallel.data_parallel_size}",
        f"  KV pages:     {info.num_pages} {info.kv_cache_dtype} pages x {info.page_size} tokens "
        f"= {tokens} tokens, {info.kv_cache_bytes / 2**20:.1f} MiB ({info.kv_cache_bytes} "
        f"bytes, {info.kv_bytes_per_token} a token); weights {info.weight_bytes / 2**20:.1f} MiB",
        f"  buckets:      tokens {info.token_buckets}, "
        f"max_num_seqs {config.scheduler.max_num_seqs}",
        *(
            [
                f"  LoRA:         {info.max_loras} slots of rank {info.max_lora_rank}; adapters "
                f"{', '.join(n for n, _ in settings.lora_modules) or 'none yet'}"
                + (", loadable at run time" if settings.allow_runtime_lora_updating else "")
            ]
            if info.max_loras
            else []
        ),
        f"  scheduling:   policy {sched.scheduling_policy}, prefix caching "
        f"{'on' if config.cache.enable_prefix_caching else 'off'}, watermark "
        f"{sched.watermark_pages(info.num_pages)} pages, at most "
        f"{config.limits.max_waiting_requests} waiting",
        f"  compiled in:  {info.compile_seconds:.1f} s"
        + (
            f", {later} more buckets compiling in the background (--compile-in-background)"
            if (later := info.compile_cache.get("buckets_in_background"))
            else ""
        ),
        f"  gc:           {frozen} start-up objects frozen (full collections skip them)",
        f"  listening on: {url}  (OpenAI base_url {url}/v1)",
        f"  try:          {curl}",
    ]
    logger.info("\n".join(lines))


class _Server(uvicorn.Server):
    """uvicorn.Server that drains on the first SIGINT/SIGTERM and exits 0 afterwards.

    Until the engine loop has drained, uvicorn is not told to exit: it keeps accepting
    connections, keep-alive ones stay open, and new requests get the loop's 503 (uvicorn's
    own shutdown would refuse new connections and close idle ones without an answer). A
    second signal aborts what runs and quits at once; the handlers it cancels are not
    errors, so their tracebacks are not logged (_QuietCancellation).

    (uvicorn re-raises a caught signal once it has shut down, which would end the process
    with the signal's status instead of 0; this subclass does not.)
    """

    def __init__(self, config: uvicorn.Config, engine_loop: EngineLoop, grace: float) -> None:
        super().__init__(config)
        self._engine_loop = engine_loop
        self._grace = grace
        self._num_signals = 0

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._num_signals += 1
        if self._num_signals == 1:
            self._engine_loop.begin_drain(self._grace)  # on_tick exits once it has drained
            return
        if self._num_signals == 2:
            logger.warning("second %s: quitting now", signal.Signals(sig).name)
            self._engine_loop.stop(timeout=0)  # aborts everything left, without waiting
        self.should_exit = self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self._num_signals and self._engine_loop.drained:
            self.should_exit = True
        return await super().on_tick(counter)


class _QuietCancellation(logging.Filter):
    """Drops uvicorn's tracebacks of tasks cancelled on a forced exit (request handlers as
    exceptions, the lifespan as the text Starlette reports): cancelled is what they were
    asked to be."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError):
            return False
        text = record.getMessage()
        return not (text.startswith("Traceback") and text.rstrip().endswith("CancelledError"))


def _cpu_line(kernels: dict) -> str:
    """The CPU, its relevant flags and the ISA level jaxcb's native kernels run at."""
    return f"{kernels['cpu']}, native kernels at {kernels['isa_level']}"
