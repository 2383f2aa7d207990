"""The router's current routing policy: one owner, replaced whole between two requests.

``PolicySlot.current`` is an ``ActivePolicy``: the built policy with the name, knobs and
version it came from. ``Router.dispatch`` reads it once per request and the ``Dispatch``
keeps that policy for its ``on_complete``, so a request in flight finishes with the policy
that chose its worker while the next request is routed by the new one.

Versions order the changes: the configured policy is version 0 and every change is newer.
``install`` takes only a version newer than the current one, so however the news of
changes reaches a replica (its own admin call, the fleet's copy in Redis, in any order),
it ends on the most recent change. Without shared state a change is the current version
+ 1; with it, Redis numbers the changes for the whole fleet (``router/replication/policy.py``)
through ``publisher``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from policies.base import Policy
from policies.registry import build_policy, policy_knobs
from router.observability.metrics import RouterMetrics

log = logging.getLogger(__name__)

# (policy name, knobs as given, the publishing replica's version) -> the fleet's version
# for the change. Raises a RouterError when the change cannot be published.
Publisher = Callable[[str, Mapping[str, Any], int], Awaitable[int]]


@dataclass(frozen=True, slots=True)
class ActivePolicy:
    """A built policy and what it was built from."""

    name: str
    knobs: Mapping[str, Any]  # as given; the policy's defaults fill in the rest
    version: int
    policy: Policy

    @property
    def settings(self) -> dict[str, Any]:
        """Every knob in force: the given ones over the policy's defaults."""
        return {**policy_knobs(self.name), **self.knobs}

    def knobs_label(self) -> str:
        """The knobs in force as one metric label value, ``cache_weight=2.0,temperature=0.0``."""
        return ",".join(f"{k}={v}" for k, v in sorted(self.settings.items()))

    def describe(self) -> dict[str, Any]:
        return {"policy": self.name, "knobs": self.settings, "version": self.version}


class PolicySlot:
    """Holds the current policy; every policy it builds gets the router's seed."""

    def __init__(
        self,
        name: str,
        knobs: Mapping[str, Any],
        seed: int | None,
        metrics: RouterMetrics,
    ) -> None:
        self._seed = seed
        self._metrics = metrics
        self.current = self.build(name, knobs, 0)
        metrics.policy_info.labels(name, self.current.knobs_label()).set(1)
        self.publisher: Publisher | None = None

    def build(self, name: str, knobs: Mapping[str, Any], version: int) -> ActivePolicy:
        """A policy, not yet installed. PolicyConfigError for an unknown name (listing the
        known ones) or a bad knob: the registry's check, the one the config file gets."""
        return ActivePolicy(name, dict(knobs), version, build_policy(name, knobs, self._seed))

    async def change(self, name: str, knobs: Mapping[str, Any]) -> ActivePolicy:
        """Validate, number (fleet-wide through ``publisher`` when there is one) and
        install a new policy; returns the policy now current, which is a newer change
        than this one if such a change was installed in the meantime."""
        candidate = self.build(name, knobs, self.current.version + 1)
        if self.publisher is not None:
            version = await self.publisher(name, candidate.knobs, self.current.version)
            candidate = dataclasses.replace(candidate, version=version)
        self.install(candidate)
        return self.current

    def install(self, candidate: ActivePolicy) -> bool:
        """Make ``candidate`` current if it is newer; False (nothing done) if not."""
        previous = self.current
        if candidate.version <= previous.version:
            return False
        self.current = candidate
        info = self._metrics.policy_info
        info.remove(previous.name, previous.knobs_label())
        info.labels(candidate.name, candidate.knobs_label()).set(1)
        self._metrics.policy_changes.inc()
        log.info(
            "routing policy now %s (%s), version %d; was %s",
            candidate.name,
            candidate.knobs_label() or "no knobs",
            candidate.version,
            previous.name,
        )
        return True
