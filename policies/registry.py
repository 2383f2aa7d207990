"""Every routing policy by name; the one place that builds a policy from config.

Policies are named as "module:Class" strings and imported on first use, so a policy
module that is absent (or slow to import) costs nothing until that name is built.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from typing import Any, Protocol, cast

from policies.base import Policy, PolicyConfigError

# name -> "module:Class". Each class has ``name`` (equal to its key here), a frozen
# ``params_type`` dataclass whose fields are the knobs, and ``from_knobs``.
POLICY_PATHS: Mapping[str, str] = {
    "round_robin": "policies.round_robin:RoundRobinPolicy",
    "random": "policies.random_choice:RandomPolicy",
    "least_load": "policies.least_load:LeastLoadPolicy",
    "power_of_two": "policies.power_of_two:PowerOfTwoPolicy",
    "session": "policies.session:SessionPolicy",
    "cache_aware": "policies.cache_aware:CacheAwarePolicy",
    "ttft": "policies.ttft:TtftPolicy",
}


class PolicyClass(Protocol):
    """What the registry needs of a policy class (the class object, not an instance)."""

    @property
    def name(self) -> str: ...

    @property
    def params_type(self) -> type[Any]: ...

    def from_knobs(self, knobs: Mapping[str, Any], seed: int | None = None) -> Policy: ...


def policy_names() -> list[str]:
    return sorted(POLICY_PATHS)


def policy_class(name: str) -> PolicyClass:
    """Import and return the class registered as ``name``.

    Raises PolicyConfigError for an unknown name, or a registered one whose module is
    not there. An import error inside an existing module propagates: that is a bug.
    """
    try:
        path = POLICY_PATHS[name]
    except KeyError:
        raise PolicyConfigError(
            f"unknown policy {name!r}; known policies: {', '.join(policy_names())}"
        ) from None
    module_name, _, class_name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        raise PolicyConfigError(
            f"policy {name!r} is registered but its module {module_name} is missing"
        ) from exc
    cls = getattr(module, class_name)
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise TypeError(f"{path} is not a Policy subclass")
    return cast(PolicyClass, cls)


def build_policy(
    name: str, knobs: Mapping[str, Any] | None = None, seed: int | None = None
) -> Policy:
    """A new policy ``name`` with ``knobs`` over its defaults; PolicyConfigError if bad."""
    return policy_class(name).from_knobs(knobs or {}, seed=seed)


def policy_knobs(name: str) -> dict[str, Any]:
    """The knobs of policy ``name`` with their defaults, for docs and ``--help``."""
    return dataclasses.asdict(policy_class(name).params_type())
