"""The one interface every routing policy implements.

A policy only decides. It gets a ``RouteRequest`` (built once per request) and a
snapshot of every eligible worker (``WorkerView``), and returns a ``Decision``: immutable
values, named tuples because the router makes one view per eligible worker per request
(a frozen dataclass costs three times as much to make). Health,
retries, I/O, the prefix index and metrics live in the router; every number a policy
needs (load, matched prefix, learned prefill rate) arrives in the views, so a policy is
testable with plain values.
"""

from __future__ import annotations

import abc
import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Literal, NamedTuple, Self, get_args

# Why a worker was chosen; a small fixed set, used as a metric label.
Reason = Literal["prefix", "load", "session", "rotation", "random", "ttft", "only_choice"]
REASONS: tuple[Reason, ...] = get_args(Reason)


class RouteRequest(NamedTuple):
    """What the router knows of a request before choosing a worker."""

    request_id: str
    model: str
    session_key: str | None
    # Chained hashes of the prompt's prefix blocks (see router.index.prefix); block i names
    # the whole prefix up to and including block i.
    block_hashes: tuple[int, ...]
    block_tokens: int  # estimated tokens per block
    prompt_tokens: int  # estimated tokens of the whole prompt
    # The conversation's first turn (no reply in it yet): what of it a worker holds is
    # a prefix other sessions share, not this session's own history.
    first_turn: bool = False
    # The worker of the session that spawned this one (a subagent's parent), if known.
    parent_worker: str | None = None


class WorkerView(NamedTuple):
    """One eligible worker as the policy sees it for this request."""

    name: str
    # Dispatched by this router and its replicas and not yet finished, or what the engine
    # reports running + waiting, whichever is larger.
    outstanding_requests: int
    outstanding_tokens: int  # prompt tokens of those requests
    queued_prefill_tokens: int  # uncached prompt tokens dispatched, first byte not yet seen
    matched_tokens: int  # this request's prefix the worker is modelled to hold
    resident_tokens: int  # tokens the worker is modelled to hold in all
    capacity_tokens: int  # the worker's KV capacity in tokens
    prefill_tokens_per_s: float  # learned from observed TTFTs
    # Prompt tokens sent to the worker lately, fading with a half-life (router.fleet.demand):
    # the live sessions' context, where resident tokens also count finished ones.
    recent_prompt_tokens: float = 0.0
    # The engine's KV block size in tokens (0: not known): it holds whole blocks only.
    cache_block_tokens: int = 0
    # Of the cached tokens this request would push out of the worker's cache (its new
    # tokens past the capacity), how many the sessions they belong to are expected to
    # come back for, learned from when sessions return (router.routing.returns); 0
    # unless the policy ``counts_returns``.
    returning_evicted_tokens: float = 0.0
    # Of the prompt beyond ``matched_tokens``, the tokens the worker's engine holds in its
    # CPU tier (offloaded), unbroken from where the match ends: it would read them back
    # over the host link, at ``reload_tokens_per_s`` (0: not known), before prefilling
    # the rest.
    offloaded_tokens: int = 0
    reload_tokens_per_s: float = 0.0


class Decision(NamedTuple):
    worker: str
    reason: Reason
    # Tokens of the prompt the chosen worker is predicted to hold.
    predicted_cached_tokens: int = 0


# "rejected": the engine answered 4xx (the request's own fault).
Outcome = Literal["success", "upstream_error", "client_disconnect", "timeout", "rejected"]


class PolicyConfigError(ValueError):
    """A policy name or knob that does not exist or has a bad value."""


class Policy(abc.ABC):
    """Chooses a worker for each request.

    ``candidates`` is never empty: the router answers "no eligible worker" itself.
    The hooks are optional; the default does nothing.

    A concrete policy defined in a module of the ``policies`` package is registered by
    its ``name`` (``policies.registry``). Its knobs are the fields of ``params_type``, a
    frozen dataclass whose every field has a default; its constructor takes that
    dataclass first, and a ``seed`` keyword if it draws random numbers.
    """

    name: ClassVar[str]
    params_type: ClassVar[type[Any]]

    @classmethod
    def from_knobs(cls, knobs: Mapping[str, Any], seed: int | None = None) -> Self:
        """A policy with ``knobs`` over the defaults of ``params_type``.

        Raises PolicyConfigError naming the knob that does not exist or has a bad value.
        ``seed`` reaches only a constructor that takes one; the others are deterministic.
        """
        params = params_from(cls.params_type, knobs, cls.name)
        construct: Callable[..., Self] = cls
        if "seed" in inspect.signature(cls).parameters:
            return construct(params, seed=seed)
        return construct(params)

    @property
    def counts_returns(self) -> bool:
        """The policy reads ``WorkerView.returning_evicted_tokens`` (the router counts
        it only then: it walks each full worker's oldest sessions)."""
        return False

    @abc.abstractmethod
    def choose(self, request: RouteRequest, candidates: Sequence[WorkerView]) -> Decision: ...

    def on_dispatch(self, request: RouteRequest, worker: str) -> None:  # noqa: B027
        """The request was sent to ``worker``."""

    def on_complete(  # noqa: B027
        self, request: RouteRequest, worker: str, outcome: Outcome
    ) -> None:
        """The request left ``worker`` (whatever the outcome)."""


def params_from(cls: type[Any], knobs: Mapping[str, Any], policy: str) -> Any:
    """Build a policy's frozen params dataclass from a mapping, naming bad knobs.

    A knob must be a field of ``cls`` and of the kind of its default (a number or a
    string); then ``cls``'s own ``__post_init__`` checks the values.
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(knobs) - set(fields))
    if unknown:
        raise PolicyConfigError(
            f"policy {policy!r} has no knob {unknown[0]!r}; knobs: {', '.join(sorted(fields))}"
        )
    wrong = next((k for k in sorted(knobs) if not _same_kind(knobs[k], fields[k].default)), None)
    if wrong is not None:
        default = fields[wrong].default
        expected = (
            "true or false"
            if isinstance(default, bool)
            else "a string"
            if isinstance(default, str)
            else "a number"
        )
        raise PolicyConfigError(
            f"policy {policy!r}: {wrong} must be {expected}, got {knobs[wrong]!r}"
        )
    try:
        return cls(**knobs)
    except (TypeError, ValueError) as exc:
        raise PolicyConfigError(f"policy {policy!r}: {exc}") from exc


def _same_kind(value: Any, default: Any) -> bool:
    """``value`` has the kind of ``default``: true or false, a number (a bool counts, as
    in Python), or a string; anything else is not checked here."""
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, int | float):
        return isinstance(value, int | float)
    if isinstance(default, str):
        return isinstance(value, str)
    return True
