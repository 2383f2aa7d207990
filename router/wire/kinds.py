"""The kinds of request the router and the simulated engine tell apart."""

from __future__ import annotations

from typing import Literal

# What an engine renders a prompt from: chat messages, or a completion's prompt.
PromptKind = Literal["chat", "completion"]
# The client APIs the router keys and routes: a Responses or Messages request is keyed
# as the chat request the engine runs it as (router.apis).
Kind = Literal[PromptKind, "responses", "messages"]
# What a reply leaves its session doing: waiting on a tool it called (an agent is back as
# soon as the tool returns, often within a second) or on a person (minutes).
TurnEnd = Literal["tool", "user"]
