"""``kvrouter bench apis``: the agent workload replayed through each client API, side
by side: OpenAI Chat Completions, OpenAI Responses, Anthropic Messages.

The same fleet, the same sessions and the same router (one policy) each round; only the
API the client speaks changes, so the figures say what each API's path through the
router costs or keeps: its prefix keys (a Responses or Messages request is keyed as the
chat request the engine runs it as), its reply capture (the next turn's chain) and its
usage (each API reports the cache hit in its own fields).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any

from rich.console import Console

from bench.compare.demo import (
    RouterSpec,
    add_workload_arguments,
    demo_config,
    kvrouter_spec,
    run_comparison,
    run_on_clock,
)
from bench.workloads.api_bodies import APIS

DEFAULT_POLICY = "ttft"


def register(commands: argparse._SubParsersAction[Any]) -> None:
    parser = commands.add_parser(
        "apis",
        help="the agent workload through chat, responses and messages, side by side",
        description=__doc__,
    )
    add_workload_arguments(parser)
    parser.set_defaults(func=run, policies=DEFAULT_POLICY)


def run(args: argparse.Namespace) -> int:
    config = demo_config(args)
    policy = config.policies[0]

    def specs(urls: Sequence[str]) -> list[RouterSpec]:
        one = kvrouter_spec(config, policy, urls)
        return [dataclasses.replace(one, label=api, api=api) for api in APIS]

    title = f"kvrouter ({policy}) through each client API"
    return run_on_clock(config, lambda: run_comparison(config, Console(), specs, title=title))
