"""The admin API: list, add, remove, drain and migrate workers, change the policy, at runtime.

Off unless an admin token is configured (``admin_token`` / ``--admin-token`` /
``KVROUTER_ADMIN_TOKEN``); every call needs ``Authorization: Bearer <token>``.

    GET    /admin/workers                     workers with state, load, resident tokens
    POST   /admin/workers                     {"url": ..., "name"?: ..., "kv_tokens"?: ...}
    DELETE /admin/workers/{name}
    POST   /admin/workers/{name}/drain        no new requests; in-flight ones finish
    DELETE /admin/workers/{name}/drain        back in rotation
    POST   /admin/workers/{name}/migrate      {"to": "other", "checkpoint_taken_at"?: t}:
                                              its KV state (as at t) was restored on
                                              another worker; its index entries move there
    GET    /admin/policy                      {"policy", "knobs" (all, defaults included),
                                              "version"}
    PUT    /admin/policy                      {"policy"?: ..., "knobs"?: {...}}: routes the
                                              next request; in-flight ones are unaffected
    GET    /admin/admission                   the queue's settings (``admission``), what it
                                              holds per class and worker
    PUT    /admin/admission                   {setting: value, ...}: over the current
                                              settings; held requests keep their deadlines;
                                              with shared state, every replica's

``PUT /admin/policy``: without ``policy`` the current one is kept; ``knobs`` are given over
the policy's defaults (not over its current knobs), so leaving them out resets them. Names
and knobs are checked by the policy registry, as in the config file. With shared state the
change reaches every replica (``router/replication/policy.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any
from urllib.parse import urlsplit

import orjson

from policies.base import PolicyConfigError
from policies.registry import policy_class
from router.config import PRIORITIES, AdmissionConfig, WorkerConfig
from router.config_loader import build
from router.edge.routes import Answer, Call, Handler, json_answer
from router.errors import BadRequest, ConfigError, Conflict, NotFound
from router.fleet.workers import Worker
from router.state import RouterState


def _describe(state: RouterState, worker: Worker) -> dict[str, Any]:
    index, block_tokens = state.router.index, state.router.block_tokens
    return {
        "name": worker.name,
        "url": worker.url,
        "healthy": worker.healthy,
        "draining": worker.draining,
        "circuit": worker.breaker.reported_state.name.lower(),
        "models": sorted(worker.models),
        "outstanding_requests": worker.outstanding_requests,
        "outstanding_tokens": worker.outstanding_tokens,
        "engine_running": worker.engine_running,
        "engine_waiting": worker.engine_waiting,
        "engine_kv_usage": worker.engine_kv_usage,
        "resident_tokens": index.resident_blocks(worker.name) * block_tokens,
        "capacity_tokens": worker.capacity_tokens,
        "engine_block_tokens": worker.engine_block_tokens,
        "prefix_mode": index.prefix_mode(worker.name),
        "kv_events": state.kv_events.status(worker.name) if state.kv_events else None,
    }


def _worker(state: RouterState, name: str) -> Worker:
    worker = state.router.fleet.workers.get(name)
    if worker is None:
        raise NotFound(f"no worker named {name!r}")
    return worker


def _body(call: Call) -> dict[str, Any]:
    try:
        body = orjson.loads(call.request.body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


async def list_workers(call: Call) -> Answer:
    state = call.state
    return json_answer(
        {
            "workers": [_describe(state, w) for w in state.router.fleet.all()],
            "policy": state.router.policies.current.describe(),
        }
    )


WORKER_FIELDS = ("url", "name", "kv_tokens", "kv_events")


def _worker_config(body: dict[str, Any]) -> WorkerConfig:
    """The body's worker, typed and checked as a config file's worker is (a name that is
    not a string would break every /metrics scrape after it)."""
    try:
        config: WorkerConfig = build(
            WorkerConfig, {k: body[k] for k in WORKER_FIELDS if k in body}, "worker"
        )
        # WorkerConfig lets a port past 65535 through (urlsplit checks it only here).
        urlsplit(config.url).port  # noqa: B018
    except ValueError as exc:  # ConfigError, or urlsplit's own (an unclosed IPv6 bracket)
        raise BadRequest(f"bad worker: {exc}") from None
    return config


async def add_worker(call: Call) -> Answer:
    state = call.state
    config = _worker_config(_body(call))
    if config.name in state.router.fleet.workers:
        raise Conflict(f"a worker named {config.name!r} exists")
    if config.kv_events is not None and state.kv_events is None:
        raise BadRequest("kv_events: exact mode keys prompts by tokens; set prefix.tokenizer")
    worker = state.add_worker(config)
    await state.prober.probe_all()
    return json_answer(_describe(state, worker), status=201)


async def remove_worker(call: Call) -> Answer:
    state = call.state
    worker = _worker(state, call.request.params["name"])
    state.membership.remove(worker.name)
    return json_answer({"removed": worker.name})


async def drain(call: Call) -> Answer:
    state = call.state
    worker = _worker(state, call.request.params["name"])
    worker.draining = call.request.method == "POST"
    return json_answer(_describe(state, worker))


async def migrate(call: Call) -> Answer:
    state = call.state
    source = _worker(state, call.request.params["name"])
    body = _body(call)
    target_name = body.get("to")
    taken_at = body.get("checkpoint_taken_at")
    if taken_at is not None and (
        not isinstance(taken_at, int | float) or isinstance(taken_at, bool)
    ):
        raise BadRequest(
            "'checkpoint_taken_at' must be the checkpoint's time, in seconds since the epoch",
            param="checkpoint_taken_at",
        )
    if not isinstance(target_name, str):
        raise BadRequest("'to' must name the worker the state was restored on", param="to")
    target = _worker(state, target_name)
    if target is source:
        raise BadRequest("'to' must be another worker", param="to")
    # The restore started a new process on the target: its restart is seen now, so the
    # purge it calls for comes before the migrated entries, not after them.
    await state.prober.refresh(target)
    moved = state.membership.migrate(source.name, target.name, taken_at)
    return json_answer(
        {"from": source.name, "to": target.name, "moved_tokens": moved * state.router.block_tokens}
    )


async def get_policy(call: Call) -> Answer:
    return json_answer(call.state.router.policies.current.describe())


POLICY_FIELDS = ("knobs", "policy")


async def put_policy(call: Call) -> Answer:
    policies = call.state.router.policies
    body = _body(call)
    unknown = sorted(set(body) - set(POLICY_FIELDS))
    if unknown:
        raise BadRequest(
            f"unknown field {unknown[0]!r}; known: {', '.join(POLICY_FIELDS)}", param=unknown[0]
        )
    if not body:
        raise BadRequest("give 'policy', 'knobs' or both")
    name, knobs = body.get("policy", policies.current.name), body.get("knobs", {})
    if not isinstance(name, str):
        raise BadRequest("'policy' must be a string", param="policy")
    if not isinstance(knobs, dict):
        raise BadRequest("'knobs' must be an object", param="knobs")
    try:
        policy_class(name)
    except PolicyConfigError as exc:
        raise BadRequest(str(exc), param="policy") from None
    try:
        active = await policies.change(name, knobs)
    except PolicyConfigError as exc:
        raise BadRequest(str(exc), param="knobs") from None
    return json_answer(active.describe())


def _admission(state: RouterState) -> dict[str, Any]:
    queue = state.queue
    settings = dataclasses.asdict(queue.limits)
    settings["batch_api_keys"] = len(queue.limits.batch_api_keys)  # secrets: their number
    return {
        "settings": settings,
        "version": queue.settings_version,
        "held": {p: queue.depth(p) for p in PRIORITIES},
        "held_prefill_tokens": dict(sorted(queue.held_prefill.items())),
    }


async def get_admission(call: Call) -> Answer:
    return json_answer(_admission(call.state))


async def put_admission(call: Call) -> Answer:
    state = call.state
    body = _body(call)
    if not body:
        raise BadRequest("give at least one setting of admission")
    current = dataclasses.asdict(state.queue.limits)
    try:
        limits: AdmissionConfig = build(AdmissionConfig, {**current, **body}, "admission")
    except ConfigError as exc:
        raise BadRequest("; ".join(exc.problems)) from None
    if not set(limits.batch_api_keys) <= set(state.config.api_keys):
        raise BadRequest("admission.batch_api_keys: every key must be one of api_keys")
    await state.queue.change(dataclasses.asdict(limits), limits)
    return json_answer(_admission(state))


ROUTES: tuple[tuple[str, str, Handler], ...] = (
    ("GET", "/admin/workers", list_workers),
    ("POST", "/admin/workers", add_worker),
    ("DELETE", "/admin/workers/{name}", remove_worker),
    ("POST", "/admin/workers/{name}/drain", drain),
    ("DELETE", "/admin/workers/{name}/drain", drain),
    ("POST", "/admin/workers/{name}/migrate", migrate),
    ("GET", "/admin/policy", get_policy),
    ("PUT", "/admin/policy", put_policy),
    ("GET", "/admin/admission", get_admission),
    ("PUT", "/admin/admission", put_admission),
)
