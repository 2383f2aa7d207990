"""``kvrouter serve`` and ``kvrouter check-config``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import logging
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import yaml

from policies.registry import policy_names
from router.config import RouterConfig
from router.config_loader import load_config
from router.errors import ConfigError
from router.processes.slot import ProcessSlot, read_config

log = logging.getLogger(__name__)


def _knob(text: str) -> tuple[str, Any]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, yaml.safe_load(value)  # numbers and booleans as YAML reads them


def register(commands: argparse._SubParsersAction[Any]) -> None:
    serve = commands.add_parser(
        "serve",
        help="run the router",
        description="Run the router. Flags override KVROUTER_* environment variables, "
        "which override the config file.",
    )
    serve.add_argument("--config", type=Path, help="YAML config file")
    defaults = RouterConfig()
    serve.add_argument(
        "--host",
        help=f"address to listen on (default {defaults.host}: every interface; "
        "127.0.0.1 for this machine only)",
    )
    serve.add_argument("--port", type=int, help=f"port to listen on (default {defaults.port})")
    serve.add_argument(
        "--worker",
        action="append",
        dest="workers",
        metavar="URL",
        help="an engine's base URL (repeat for each worker)",
    )
    serve.add_argument(
        "--policy", help=f"one of {', '.join(policy_names())} (default {defaults.policy})"
    )
    serve.add_argument(
        "--policy-knob",
        action="append",
        type=_knob,
        dest="knobs",
        metavar="NAME=VALUE",
        help="a policy knob (repeatable)",
    )
    serve.add_argument(
        "--admission",
        action="append",
        type=_knob,
        dest="admission",
        metavar="NAME=VALUE",
        help="a setting of the router's queue, e.g. enabled=true (repeatable; "
        "docs/configuration.md)",
    )
    serve.add_argument(
        "--kv-tokens",
        type=int,
        help="every worker's KV capacity in tokens (default: read from the engines' /metrics)",
    )
    serve.add_argument(
        "--block-bytes",
        type=int,
        help="prefix block size in bytes (default 256 by text; by tokens 64, 16 tokens, "
        "which any engine's block size is a multiple of)",
    )
    serve.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="key prompts by the model's own tokens: a directory with tokenizer.json "
        "and tokenizer_config.json, or 'engine' to ask a worker's /tokenize "
        "(prefix.tokenizer)",
    )
    serve.add_argument(
        "--max-attempts",
        type=int,
        help=f"workers tried before the first byte (default {defaults.upstream.max_attempts})",
    )
    serve.add_argument(
        "--seed", type=int, help="seed for policies that draw at random (default: unseeded)"
    )
    serve.add_argument(
        "--admin-token",
        metavar="TOKEN",
        help="enable the admin API, with this bearer token (prefer "
        "KVROUTER_ADMIN_TOKEN: flags show in process lists)",
    )
    serve.add_argument(
        "--worker-header",
        action="store_true",
        default=None,
        help="send X-Kvrouter-Worker (which worker served) on responses",
    )
    serve.add_argument(
        "--session-header",
        dest="session_headers",
        action="append",
        metavar="NAME",
        help="read a session key from this request header before the built-in sources "
        "(repeatable; see session_keys in the configuration)",
    )
    serve.add_argument(
        "--log-requests",
        action="store_true",
        default=None,
        help="one JSON line per request (decision, worker, cached tokens, "
        "TTFT; never prompts or headers)",
    )
    serve.add_argument(
        "--state",
        metavar="URL",
        help="share routing state with other replicas through Redis "
        "(redis://host:port/db, rediss://, redis+sentinel://, "
        "redis+cluster://)",
    )
    serve.add_argument(
        "--no-read-your-writes",
        dest="read_your_writes",
        action="store_false",
        default=None,
        help="with --state: route on each replica's mirror alone, without the Redis "
        "round trips on a request's path (state.read_your_writes = false)",
    )
    serve.add_argument(
        "--processes",
        type=int,
        metavar="N",
        help="N processes serving the port together, sharing state through --state or, "
        "without it, a Valkey of their own (default 1; Linux)",
    )
    # Internal: set by the supervisor of --processes N on each of its processes.
    serve.add_argument("--process-slot", metavar="INDEX:DIR", help=argparse.SUPPRESS)
    serve.set_defaults(func=run_serve)

    check = commands.add_parser(
        "check-config",
        help="validate a config file and exit",
        description="Validate a config file and name every setting that is wrong; exit 0 "
        "when it is valid, 1 when it is not.",
    )
    check.add_argument("file", type=Path, help="the YAML config file")
    check.set_defaults(func=run_check)


def flag_overrides(args: argparse.Namespace) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name in ("host", "port", "policy", "seed"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    if args.workers:
        values["workers"] = args.workers
    if args.knobs:
        values["policy_knobs"] = dict(args.knobs)
    if args.admission:
        values["admission"] = dict(args.admission)
    if args.kv_tokens is not None:
        values["capacity"] = {"kv_tokens": args.kv_tokens}
    if args.block_bytes is not None:
        values["prefix"] = {"block_bytes": args.block_bytes}
    if args.tokenizer is not None:
        values.setdefault("prefix", {})["tokenizer"] = args.tokenizer
    if args.max_attempts is not None:
        values["upstream"] = {"max_attempts": args.max_attempts}
    if args.session_headers:
        values["session_headers"] = args.session_headers
    if args.log_requests:
        values["log_requests"] = True
    if args.admin_token:
        values["admin_token"] = args.admin_token
    if args.worker_header:
        values["worker_header"] = True
    if args.state is not None:
        values["state"] = {"url": args.state}
    if args.read_your_writes is not None:
        values.setdefault("state", {})["read_your_writes"] = args.read_your_writes
    if args.processes is not None:
        values["processes"] = args.processes
    return values


def run_check(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.file, environ={})
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"{args.file}: invalid: {problem}")
        return 1
    print(f"{args.file}: ok ({len(config.workers)} workers, policy {config.policy})")
    return 0


# Young-generation collections every this many net allocations (CPython's default: 700).
# A forwarded request allocates thousands of short-lived objects, so at 700 the collector
# ran several times a request: 15% of the router's CPU and most of its p99 under load.
GC_YOUNG_THRESHOLD = 10_000


def tune_gc() -> None:
    """Once the app is up: what start-up built (modules, config, the app) is frozen out of
    every future collection, and young collections run less often. Objects still die by
    reference counting as soon as they are unused; only cycles wait for a collection."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, old)


async def serve(config: RouterConfig, slot: ProcessSlot | None = None) -> None:
    """The router on ``config.port`` until SIGINT or SIGTERM; with ``slot``, as one
    process of a ``--processes N`` group (router/processes/)."""
    from router.server import RouterServer

    # First: a signal while the router starts stops it once started, cleanly.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with RouterServer(config) as server, contextlib.AsyncExitStack() as group:
        if slot is not None:
            from router.processes.siblings import joined

            await group.enter_async_context(joined(server, slot))
        await server.listen(config.host, config.port, reuse_port=slot is not None)
        if slot is not None:  # last: the supervisor counts a process up once this accepts
            await server.listen_unix(str(slot.own_socket))
        tune_gc()
        log.info("%s", started_line(config, slot))
        await stop.wait()
        await server.stop_serving()  # while the group's siblings still answer


def started_line(config: RouterConfig, slot: ProcessSlot | None = None) -> str:
    """What an operator needs to know once the router listens: where, in front of
    what, and who may use it."""
    host = f"[{config.host}]" if ":" in config.host else config.host
    where = f"http://{host}:{config.port}"
    if config.host in ("0.0.0.0", "::", ""):
        where += " (every interface)"
    keys = len(config.api_keys)
    clients = (
        f"client keys on ({keys})"
        if keys
        else "client keys off: anyone who reaches the port is served (set api_keys)"
    )
    return (
        f"kvrouter{'' if slot is None else f' process {slot.index}'} listening on {where}, "
        f"routing to {len(config.workers)} workers with policy {config.policy}; {clients}"
    )


def _process_slot(args: argparse.Namespace) -> tuple[RouterConfig, ProcessSlot | None]:
    """The config, and the slot when this is one process of a group (read from the
    supervisor's file alone: flags and environment are in it already)."""
    if args.process_slot is None:
        return load_config(args.config, flag_overrides(args)), None
    if args.config is None:
        raise ConfigError("--process-slot: needs the supervisor's --config")
    config = read_config(args.config)
    try:
        slot = ProcessSlot.parse(args.process_slot, config.processes)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if config.seed is not None:  # processes drawing in lockstep would pick alike
        config = dataclasses.replace(config, seed=config.seed + slot.index)
    return config, slot


def run_serve(args: argparse.Namespace) -> int:
    try:
        config, slot = _process_slot(args)
    except ConfigError as exc:
        _print_problems(exc)
        return 2
    if config.log_requests:
        # Bare JSON lines on stdout, apart from the human log on stderr.
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        request_logger = logging.getLogger("kvrouter.requests")
        request_logger.addHandler(handler)
        request_logger.setLevel(logging.INFO)
        request_logger.propagate = False
    if (
        not config.workers
        and not config.discovery.file
        and not config.discovery.dns
        and not config.discovery.kubernetes.selector
    ):
        print("error: no workers: give --worker URL (repeatable) or 'workers' in --config")
        return 2
    if config.processes > 1 and slot is None:
        from router.processes.supervisor import supervise

        try:
            return supervise(config, logging.getLevelName(logging.getLogger().level))
        except ConfigError as exc:
            _print_problems(exc)
            return 2
    if slot is not None:
        _label_log(slot)
    supervisor = os.getppid()
    # Until the event loop takes SIGTERM over: one that comes while this process starts
    # (a supervisor killed then) ends it through the ``finally`` below, not at once.
    signal.signal(signal.SIGTERM, _interrupted)
    try:
        with contextlib.suppress(KeyboardInterrupt):
            try:
                import uvloop
            except ImportError:
                asyncio.run(serve(config, slot))
            else:
                uvloop.run(serve(config, slot))
    finally:
        if slot is not None and os.getppid() != supervisor:
            # The supervisor was killed (this process stopped on PR_SET_PDEATHSIG), so
            # nobody else will remove its run directory, and its config holds the secrets.
            shutil.rmtree(slot.run_dir, ignore_errors=True)
    return 0


def _print_problems(error: ConfigError) -> None:
    for problem in error.problems:
        print(f"error: {problem}")


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


class _ProcessLabel(logging.Filter):
    """Starts each message with the process's index: the processes share one stderr."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self._prefix = f"[process {index}] "

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "kvrouter_labelled", False):  # once, whatever the handlers
            record.msg = self._prefix + str(record.msg)
            record.kvrouter_labelled = True
        return True


def _label_log(slot: ProcessSlot) -> None:
    label = _ProcessLabel(slot.index)
    for handler in logging.getLogger().handlers:  # not the request log's: bare JSON lines
        handler.addFilter(label)
