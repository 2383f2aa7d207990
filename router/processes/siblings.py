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
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson

from router.config import WorkerConfig
from router.edge.routes import Answer, Call, Handler, Request
from router.processes import exposition
from router.processes.slot import ProcessSlot
from router.state import RouterState

if TYPE_CHECKING:
    from router.server import RouterServer

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


def _from_sibling(request: Request) -> bool:
    """Whether the request came in on this process's own socket: then it is answered as
    this process alone."""
    return request.via_socket_path


def _passed(request: Request) -> dict[str, str]:
    wanted = {h.lower().encode(): h for h in PASSED_HEADERS}
    return {
        wanted[k.lower()]: v.decode("latin-1") for k, v in request.headers if k.lower() in wanted
    }


def _group_metrics(siblings: Siblings, slot: ProcessSlot) -> Callable[[Handler], Handler]:
    """``GET /metrics`` on the public port: every process's, merged."""

    def wrap(own_metrics: Handler) -> Handler:
        async def group_metrics(call: Call) -> Answer | None:
            own = await own_metrics(call)
            if own is None or own.status != 200 or _from_sibling(call.request):
                return own
            headers = _passed(call.request)
            replies = await asyncio.gather(
                *(siblings.call(i, "GET", "/metrics", headers) for i in siblings.indexes)
            )
            scrapes: list[tuple[int, bytes | None]] = [(slot.index, own.body)]
            for index, reply in zip(siblings.indexes, replies, strict=True):
                scrapes.append((index, reply[1] if reply is not None and reply[0] == 200 else None))
            return replace(own, body=exposition.merge(scrapes))

        return group_metrics

    return wrap


def _fanned_out(siblings: Siblings, slot: ProcessSlot) -> Callable[[Handler], Handler]:
    """An admin change of this process's fleet, made on every sibling once it took here."""

    def wrap(change: Handler) -> Handler:
        async def on_every_process(call: Call) -> Answer | None:
            answer = await change(call)
            request = call.request
            if answer is None or answer.status >= 300 or _from_sibling(request):
                return answer
            headers = _passed(request)
            target = request.target.decode("latin-1")
            replies = await asyncio.gather(
                *(
                    siblings.call(i, request.method, target, headers, request.body)
                    for i in siblings.indexes
                )
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
            return answer.with_header(APPLIED_HEADER.encode(), f"{applied}/{slot.count}".encode())

        return on_every_process

    return wrap


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


@contextlib.asynccontextmanager
async def joined(server: RouterServer, slot: ProcessSlot) -> AsyncIterator[None]:
    """Make ``server`` (running, not yet listening) a member of the group, until exit."""
    siblings = Siblings(slot)
    try:
        server.routes.wrap("GET", "/metrics", _group_metrics(siblings, slot))
        if server.config.admin_token:
            for method, route in FANNED_OUT:
                server.routes.wrap(method, route, _fanned_out(siblings, slot))
            await _catch_up(server.state, siblings)
        yield
    finally:
        await siblings.aclose()
