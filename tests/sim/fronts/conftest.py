"""The simulated engine's tests that hold for both of its HTTP front-ends (aiohttp, and
httptools in a process of its own): ``sim`` and ``engine_factory`` run each test behind
each in turn."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.conftest import EngineFactory, RunningEngine, engine_config
from tests.sim_servers import FRONTS, factory_on, serve_engine_on


@pytest.fixture(params=FRONTS)
async def sim(request: pytest.FixtureRequest) -> AsyncIterator[RunningEngine]:
    """``tests.conftest.sim`` behind each HTTP front-end in turn."""
    async with serve_engine_on(request.param, engine_config()) as running:
        yield running


@pytest.fixture(params=FRONTS)
def engine_factory(request: pytest.FixtureRequest) -> EngineFactory:
    """``tests.conftest.engine_factory`` behind each HTTP front-end in turn."""
    return factory_on(request.param)
