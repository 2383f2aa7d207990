"""Every routing policy by name; the one place that builds a policy from config.

A policy registers itself by being defined: every concrete ``Policy`` subclass with its
own ``name`` in a module of the ``policies`` package is found by that name, so adding a
policy is adding one module. The package is scanned and its modules imported on first
use of the registry, not on import of this module.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
from collections.abc import Mapping
from typing import Any

from policies.base import Policy, PolicyConfigError

# What the registry hands out: a policy class (``name``, ``params_type``, ``from_knobs``).
PolicyClass = type[Policy]


class PolicyRegistry:
    """The policies defined in the modules of one package, discovered on first use."""

    def __init__(self, package: str) -> None:
        self.package = package
        self._classes: dict[str, PolicyClass] | None = None

    def classes(self) -> Mapping[str, PolicyClass]:
        if self._classes is None:
            self._classes = discover(self.package)
        return self._classes

    def names(self) -> list[str]:
        return sorted(self.classes())

    def policy_class(self, name: str) -> PolicyClass:
        """The class registered as ``name``; PolicyConfigError listing the known ones."""
        try:
            return self.classes()[name]
        except KeyError:
            raise PolicyConfigError(
                f"unknown policy {name!r}; known policies: {', '.join(self.names())}"
            ) from None

    def build(
        self, name: str, knobs: Mapping[str, Any] | None = None, seed: int | None = None
    ) -> Policy:
        return self.policy_class(name).from_knobs(knobs or {}, seed=seed)

    def knobs(self, name: str) -> dict[str, Any]:
        return dataclasses.asdict(self.policy_class(name).params_type())


def discover(package: str) -> dict[str, PolicyClass]:
    """Import every module of ``package`` and return its policies by name.

    A module that fails to import is an ImportError naming it (a broken policy module is
    a bug, not a config error); so are two classes claiming one name, and a policy
    without a frozen ``params_type`` dataclass is a TypeError.
    """
    found: dict[str, PolicyClass] = {}
    for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
        module_name = f"{package}.{info.name}"
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:
            raise ImportError(
                f"policy module {module_name} failed to import: {exc!r}", name=module_name
            ) from exc
        for cls in vars(module).values():
            if not _defines_policy(cls, module_name):
                continue
            other = found.setdefault(cls.name, cls)
            if other is not cls:
                raise ImportError(
                    f"policy {cls.name!r} is defined twice: "
                    f"{other.__module__}.{other.__qualname__} and {module_name}.{cls.__qualname__}"
                )
    return found


def _defines_policy(obj: object, module_name: str) -> bool:
    """``obj`` is a concrete policy named in ``module_name`` itself (not imported into it,
    not a subclass that only inherits another policy's name)."""
    if not (isinstance(obj, type) and issubclass(obj, Policy)):
        return False
    if obj.__module__ != module_name or "name" not in vars(obj) or inspect.isabstract(obj):
        return False
    params = getattr(obj, "params_type", None)
    if not (isinstance(params, type) and dataclasses.is_dataclass(params)):
        raise TypeError(f"policy {obj.name!r}: params_type must be a frozen dataclass")
    if not params.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        raise TypeError(f"policy {obj.name!r}: params_type {params.__name__} is not frozen")
    return True


POLICIES = PolicyRegistry("policies")


def policy_names() -> list[str]:
    return POLICIES.names()


def policy_class(name: str) -> PolicyClass:
    """The class registered as ``name``; PolicyConfigError for an unknown name."""
    return POLICIES.policy_class(name)


def build_policy(
    name: str, knobs: Mapping[str, Any] | None = None, seed: int | None = None
) -> Policy:
    """A new policy ``name`` with ``knobs`` over its defaults; PolicyConfigError if bad."""
    return POLICIES.build(name, knobs, seed)


def policy_knobs(name: str) -> dict[str, Any]:
    """The knobs of policy ``name`` with their defaults, for docs and ``--help``."""
    return POLICIES.knobs(name)
