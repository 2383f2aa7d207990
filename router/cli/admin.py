"""``kvrouter admin``: the admin API (``router/edge/admin.py``) from a shell.

    kvrouter admin list                      the workers, as a table
    kvrouter admin add URL [--name N] [--kv-tokens K]
    kvrouter admin remove NAME
    kvrouter admin drain NAME / undrain NAME
    kvrouter admin migrate NAME --to OTHER [--taken-at T]   NAME's KV state (as at T)
                                             was restored on OTHER
    kvrouter admin policy                    the policy, its knobs and version
    kvrouter admin policy set [NAME] [--knob k=v ...]

``--url`` (``KVROUTER_URL``), ``--token`` (``KVROUTER_ADMIN_TOKEN``), ``--timeout`` and
``--json`` go before or after the subcommand. Exit status: 0 done; 1 the router refused
(its error message on stderr); 2 the router could not be reached.

A synchronous ``httpx`` client: one request per command, far from the request path.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import httpx
import orjson
from rich.console import Console, RenderableType
from rich.table import Table

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT_S = 10.0

Command = Callable[[httpx.Client, argparse.Namespace], Any]
Show = Callable[[Any], RenderableType]


class Refused(Exception):
    """The router answered with an error status; the message is its own."""


def _call(http: httpx.Client, method: str, path: str, body: Any = None) -> Any:
    response = http.request(method, path, json=body)
    if response.is_error:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text.strip() or response.reason_phrase
        raise Refused(f"{response.status_code}: {message}")
    return response.json()


def _worker_path(name: str, tail: str = "") -> str:
    # A default worker name is the url's host:port; quote it whole, slashes included.
    return f"/admin/workers/{quote(name, safe='')}{tail}"


def _knob(text: str) -> tuple[str, Any]:
    """``k=v``, where v is read as JSON when it parses (``0.5``, ``true``), else a
    string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected k=v, got {text!r}")
    try:
        return key, orjson.loads(value)
    except orjson.JSONDecodeError:
        return key, value


# -- commands: each makes its calls and returns what to print ------------------------------


def _list(http: httpx.Client, args: argparse.Namespace) -> Any:
    return _call(http, "GET", "/admin/workers")


def _add(http: httpx.Client, args: argparse.Namespace) -> Any:
    body: dict[str, Any] = {"url": args.worker_url}
    if args.name:
        body["name"] = args.name
    if args.kv_tokens is not None:
        body["kv_tokens"] = args.kv_tokens
    return _call(http, "POST", "/admin/workers", body)


def _remove(http: httpx.Client, args: argparse.Namespace) -> Any:
    return _call(http, "DELETE", _worker_path(args.name))


def _drain(http: httpx.Client, args: argparse.Namespace) -> Any:
    return _call(http, "POST", _worker_path(args.name, "/drain"))


def _undrain(http: httpx.Client, args: argparse.Namespace) -> Any:
    return _call(http, "DELETE", _worker_path(args.name, "/drain"))


def _migrate(http: httpx.Client, args: argparse.Namespace) -> Any:
    body: dict[str, Any] = {"to": args.to}
    if args.taken_at is not None:
        body["checkpoint_taken_at"] = args.taken_at
    return _call(http, "POST", _worker_path(args.name, "/migrate"), body)


def _policy(http: httpx.Client, args: argparse.Namespace) -> Any:
    return _call(http, "GET", "/admin/policy")


def _policy_set(http: httpx.Client, args: argparse.Namespace) -> Any:
    body: dict[str, Any] = {}
    if args.policy:
        body["policy"] = args.policy
    if args.knobs:
        body["knobs"] = dict(args.knobs)
    return _call(http, "PUT", "/admin/policy", body)


# -- printing --------------------------------------------------------------------------------


def _yes(flag: Any, yes: str = "yes", no: str = "no") -> str:
    return yes if flag else no


def _tokens(value: Any) -> str:
    return "-" if value is None else f"{value:,}"


def _workers_table(body: dict[str, Any]) -> Table:
    policy = body.get("policy") or {}
    table = Table(title=f"workers (policy {policy.get('policy', '?')})")
    columns = ("name", "url", "healthy", "draining", "circuit", "outstanding", "engine run/wait")
    for column in (*columns, "resident / capacity"):
        table.add_column(column, justify="left" if column in ("name", "url") else "right")
    for w in body["workers"]:
        table.add_row(
            w["name"],
            w["url"],
            _yes(w["healthy"], no="NO"),
            _yes(w["draining"], yes="DRAINING"),
            w.get("circuit", "-"),
            f"{w['outstanding_requests']} req / {_tokens(w['outstanding_tokens'])} tok",
            f"{_tokens(w.get('engine_running'))} / {_tokens(w.get('engine_waiting'))}",
            f"{_tokens(w['resident_tokens'])} / {_tokens(w['capacity_tokens'])}",
        )
    return table


def _policy_text(body: dict[str, Any]) -> str:
    lines = [f"policy {body['policy']} (version {body['version']})"]
    lines += [f"  {k} = {orjson.dumps(v).decode()}" for k, v in sorted(body["knobs"].items())]
    return "\n".join(lines)


def _worker_text(w: dict[str, Any]) -> str:
    state = "draining" if w["draining"] else "in rotation"
    return (
        f"{w['name']} {w['url']}: {state}, healthy {_yes(w['healthy'])}, "
        f"{w['outstanding_requests']} outstanding, capacity {_tokens(w['capacity_tokens'])} tokens"
    )


def _removed(body: dict[str, Any]) -> str:
    return f"removed {body['removed']}"


def _moved(body: dict[str, Any]) -> str:
    return f"moved {body['moved_tokens']:,} tokens from {body['from']} to {body['to']}"


# -- wiring --------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    url = args.url or os.environ.get("KVROUTER_URL") or DEFAULT_URL
    token = args.token or os.environ.get("KVROUTER_ADMIN_TOKEN") or ""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=args.timeout) as http:
            body = args.command_func(http, args)
    except Refused as exc:
        print(f"error: {url} refused: {exc}", file=sys.stderr)
        return 1
    except (httpx.TransportError, httpx.InvalidURL) as exc:
        print(
            f"error: cannot reach the router at {url}: {str(exc) or type(exc).__name__}",
            file=sys.stderr,
        )
        return 2
    if args.json:
        sys.stdout.write(orjson.dumps(body, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        # Piped output gets room for the whole table rather than the 80 columns rich assumes.
        console = Console(width=None if sys.stdout.isatty() else 200)
        console.print(args.show(body), highlight=False)
    return 0


def _client_options(parser: argparse.ArgumentParser, suppress: bool) -> None:
    """The connection options. On subcommands they default to SUPPRESS, so a value given
    before the subcommand is not overwritten by the subcommand's default."""

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    parser.add_argument(
        "--url",
        default=default(None),
        help=f"the router (default: $KVROUTER_URL, else {DEFAULT_URL})",
    )
    parser.add_argument(
        "--token", default=default(None), help="the admin token (default: $KVROUTER_ADMIN_TOKEN)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=default(DEFAULT_TIMEOUT_S),
        help=f"seconds per request (default {DEFAULT_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--json", action="store_true", default=default(False), help="print the raw JSON"
    )


def register(commands: argparse._SubParsersAction[Any]) -> None:
    admin: argparse.ArgumentParser = commands.add_parser(
        "admin", help="list, add, drain, migrate workers; the policy"
    )
    _client_options(admin, suppress=False)
    admin.set_defaults(func=run)
    sub = admin.add_subparsers(dest="admin_command", required=True, metavar="SUBCOMMAND")

    def leaf(
        parent: argparse._SubParsersAction[argparse.ArgumentParser],
        name: str,
        command: Command,
        show: Show,
        summary: str,
    ) -> argparse.ArgumentParser:
        parser = parent.add_parser(name, help=summary)
        _client_options(parser, suppress=True)
        parser.set_defaults(command_func=command, show=show)
        return parser

    leaf(sub, "list", _list, _workers_table, "the workers, with state and load")
    add = leaf(sub, "add", _add, _worker_text, "add a worker")
    add.add_argument("worker_url", metavar="URL", help="the engine's base URL")
    add.add_argument("--name", help="default: the URL's host:port")
    add.add_argument("--kv-tokens", type=int, help="KV capacity; default: read from the engine")
    for name, command, show, summary in (
        ("remove", _remove, _removed, "remove a worker"),
        ("drain", _drain, _worker_text, "no new requests; in-flight ones finish"),
        ("undrain", _undrain, _worker_text, "back in rotation"),
    ):
        leaf(sub, name, command, show, summary).add_argument(
            "name", metavar="NAME", help="the worker's name (kvrouter admin list)"
        )
    migrate = leaf(sub, "migrate", _migrate, _moved, "NAME's KV state was restored on --to")
    migrate.add_argument("name", metavar="NAME", help="the worker whose state was checkpointed")
    migrate.add_argument(
        "--to", required=True, metavar="OTHER", help="the worker it was restored on"
    )
    migrate.add_argument(
        "--taken-at",
        type=float,
        metavar="UNIX_S",
        help="when the checkpoint was taken: only what NAME held by then moves",
    )

    policy = leaf(sub, "policy", _policy, _policy_text, "show the policy; 'policy set' changes it")
    policy_sub = policy.add_subparsers(dest="policy_command", metavar="set")
    change = leaf(
        policy_sub, "set", _policy_set, _policy_text, "change the policy for the next request"
    )
    change.add_argument("policy", nargs="?", metavar="NAME", help="default: the current one")
    change.add_argument(
        "--knob",
        dest="knobs",
        action="append",
        type=_knob,
        default=[],
        metavar="K=V",
        help="over the policy's defaults (knobs left out are reset); V is JSON or a string",
    )
