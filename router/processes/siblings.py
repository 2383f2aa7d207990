"""A ``--processes N`` process's side of the group: what reaches it through the public
port and must speak for the whole router.

Each process also listens on its own Unix socket (``ProcessSlot.socket_path``), where it
answers as itself only. On the public port:

* ``GET /metrics`` answers for every process: this one's, and each sibling's read from
  its socket, merged by ``router/processes/exposition.py`` (the scrape's own
  ``Authorization`` is passed on, so ``metrics_token`` holds on every process).
* An admin change of membership (add, remove, drain, undrain a worker) that succeeds
  here is made on every sibling too, with the caller's token;
  ``X-Kvrouter-Processes-Applied: <done>/<N>`` says on how many processes it took. The
  routing policy (``PUT /admin/policy``) and a migration's index entries travel through
  the shared state instead, as between replicas.
* A process that (re)starts while a sibling runs takes that sibling's worker list and
  drain flags before it serves (with ``admin_token`` set: the admin API is how they
  could differ), so an admin change outlives a restart of one process. Membership that
  discovery manages is left to discovery, which runs in every process.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from router.config import WorkerConfig
from router.processes import exposition
from router.processes.slot import ProcessSlot
from router.state import STATE_KEY, RouterState

log = logging.getLogger(__name__)

SIBLING_TIMEOUT_S = 5.0
APPLIED_HEADER = "X-Kvrouter-Processes-Applied"
# (method, route) of the admin calls that change one process's fleet and nothing shared.
FANNED_OUT = frozenset(
    {
        ("POST", "/admin/workers"),
        ("DELETE", "/admin/workers/{name}"),
        ("POST", "/admin/workers/{name}/drain"),
        ("DELETE", "/admin/workers/{name}/drain"),
    }
)
PASSED_HEADERS = ("Authorization", "Content-Type")


class Siblings:
    """HTTP to the other processes of the group, each over its Unix socket."""

    def __init__(self, slot: ProcessSlot) -> None:
        timeout = aiohttp.ClientTimeout(total=SIBLING_TIMEOUT_S)
        self._sessions = {
            i: aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=str(slot.socket_path(i))),
                timeout=timeout,
                cookie_jar=aiohttp.DummyCookieJar(),
            )
            for i in slot.siblings
        }

    @property
    def indexes(self) -> list[int]:
        return list(self._sessions)

    async def call(
        self,
        index: int,
        method: str,
        path: str,
        headers: Mapping[str, str],
        body: bytes = b"",
    ) -> tuple[int, bytes] | None:
        """Status and body, or None if the sibling did not answer (restarting)."""
        try:
            async with self._sessions[index].request(
                method, f"http://process-{index}{path}", headers=headers, data=body or None
            ) as reply:
                return reply.status, await reply.read()
        except (aiohttp.ClientError, OSError, TimeoutError):
            return None

    async def aclose(self) -> None:
        for session in self._sessions.values():
            await session.close()


SIBLINGS_KEY = web.AppKey("kvrouter_siblings", Siblings)


def _from_sibling(request: web.Request) -> bool:
    """Whether the request came in on this process's own socket (a path, not an
    address): then it is answered as this process alone."""
    transport = request.transport
    return transport is None or isinstance(transport.get_extra_info("sockname"), str)


def _passed(request: web.Request) -> dict[str, str]:
    return {h: request.headers[h] for h in PASSED_HEADERS if h in request.headers}


async def _group_metrics(
    request: web.Request, own: web.Response, slot: ProcessSlot
) -> web.StreamResponse:
    body = own.body
    if not isinstance(body, bytes):
        return own
    siblings = request.app[SIBLINGS_KEY]
    headers = _passed(request)
    replies = await asyncio.gather(
        *(siblings.call(i, "GET", "/metrics", headers) for i in siblings.indexes)
    )
    scrapes: list[tuple[int, bytes | None]] = [(slot.index, body)]
    for index, reply in zip(siblings.indexes, replies, strict=True):
        scrapes.append((index, reply[1] if reply is not None and reply[0] == 200 else None))
    return web.Response(
        body=exposition.merge(scrapes),
        headers={"Content-Type": own.headers.get("Content-Type", "text/plain")},
    )


async def _fan_out(request: web.Request, response: web.StreamResponse, slot: ProcessSlot) -> None:
    siblings = request.app[SIBLINGS_KEY]
    body, headers = await request.read(), _passed(request)
    method, path = request.method, request.path_qs
    replies = await asyncio.gather(
        *(siblings.call(i, method, path, headers, body) for i in siblings.indexes)
    )
    applied = 1
    for index, reply in zip(siblings.indexes, replies, strict=True):
        if reply is not None and reply[0] < 300:
            applied += 1
        else:
            log.warning(
                "%s %s took on this process but not on process %d (%s)",
                request.method, request.path, index,
                "no answer" if reply is None else f"status {reply[0]}",
            )  # fmt: skip
    response.headers[APPLIED_HEADER] = f"{applied}/{slot.count}"


def group_middleware(slot: ProcessSlot) -> Middleware:
    @web.middleware
    async def for_the_group(request: web.Request, handler: Handler) -> web.StreamResponse:
        response = await handler(request)
        path = request.path  # checked first: a completion passes with two comparisons
        if path == "/metrics":
            if (
                request.method == "GET"
                and response.status == 200
                and isinstance(response, web.Response)
                and not _from_sibling(request)
            ):
                return await _group_metrics(request, response, slot)
        elif path.startswith("/admin/workers") and response.status < 300:
            resource = request.match_info.route.resource
            route = resource.canonical if resource is not None else ""
            if (request.method, route) in FANNED_OUT and not _from_sibling(request):
                await _fan_out(request, response, slot)
        return response

    return for_the_group


def take_membership(state: RouterState, listed: list[dict[str, Any]]) -> None:
    """Make this process's fleet the sibling's ``GET /admin/workers`` list: drain flags
    always; workers added and removed only where no discovery source manages them."""
    fleet, config = state.router.fleet, state.config
    theirs = {w["name"]: w for w in listed}
    discovery = config.discovery
    if not (discovery.file or discovery.dns or discovery.kubernetes.selector):
        for name in [n for n, w in fleet.workers.items() if theirs.get(n, {}).get("url") != w.url]:
            state.membership.remove(name)  # gone there, or there under another URL
        for name, worker in theirs.items():
            if name not in fleet.workers:
                state.add_worker(WorkerConfig(url=worker["url"], name=name))
    for name, worker in theirs.items():
        if name in fleet.workers:
            fleet.workers[name].draining = bool(worker["draining"])


async def _catch_up(state: RouterState, siblings: Siblings) -> None:
    headers = {"Authorization": f"Bearer {state.config.admin_token}"}
    for index in siblings.indexes:
        reply = await siblings.call(index, "GET", "/admin/workers", headers)
        if reply is None or reply[0] != 200:
            continue
        before = set(state.router.fleet.workers)
        take_membership(state, orjson.loads(reply[1])["workers"])
        if set(state.router.fleet.workers) != before:
            await state.prober.probe_all()
        log.info("took the worker list of process %d", index)
        return


def attach(app: web.Application, slot: ProcessSlot) -> None:
    """Make ``app`` (``create_app``'s, not yet started) a member of the group."""
    app.middlewares.append(group_middleware(slot))

    async def siblings_ctx(app: web.Application) -> AsyncIterator[None]:
        siblings = Siblings(slot)
        app[SIBLINGS_KEY] = siblings
        try:
            state = app[STATE_KEY]
            if state.config.admin_token:
                await _catch_up(state, siblings)
            yield
        finally:
            await siblings.aclose()

    app.cleanup_ctx.append(siblings_ctx)
