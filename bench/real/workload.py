"""``kvrouter bench real``'s workload: the coding-agent generator (``bench.workloads.agent``)
shrunk to fit a real CPU engine.

The engines' context is 2,048 tokens (``bench.real.vllm_cpu.MAX_MODEL_LEN``), so a session
stays under ``MAX_CONTEXT_TOKENS``: a ~600-token agent system prompt (one of two, so
sessions share a prefix with some of the others), 100-200 new tokens a turn, 32-64 reply
tokens, 4-6 turns, sessions a few seconds apart. Sizes here are stand-in words
(``bench.textgen``), each ~1.27 of Qwen3's tokens, so they are the Qwen3 figures divided
by that; the replies are the random-weight model's own tokens, which may re-encode to
more tokens than were generated, and the limit leaves room for that and the template.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from bench.workloads.agent import AgentParams, generate
from bench.workloads.sampling import LogNormal
from bench.workloads.trace import Turn, text_tokens

DEFAULT_SESSIONS = 8
DEFAULT_RATE = 0.33  # sessions/s: one every three seconds on average
DEFAULT_SEED = 7
MAX_CONTEXT_TOKENS = 1_350  # ~1,700 of Qwen3's; the engines take 2,048
SYSTEM_PROMPTS = (470, 470)  # two agents' prompts, each shared by about half the sessions
TURNS = LogNormal(median=5, sigma=0.3, low=4, high=6)
USER_TOKENS = LogNormal(median=118, sigma=0.25, low=80, high=157)
REPLY_TOKENS = LogNormal(median=48, sigma=0.25, low=32, high=64)  # the engine's own tokens
TOOL_TIME_S = LogNormal(median=1.5, sigma=0.5, low=0.5, high=4.0)


@dataclass(frozen=True, slots=True)
class RealWorkload:
    """How many agent sessions, how fast they arrive, and the draw's seed."""

    sessions: int = DEFAULT_SESSIONS
    rate: float = DEFAULT_RATE
    seed: int = DEFAULT_SEED

    def __post_init__(self) -> None:
        if self.sessions < 1:
            raise ValueError("sessions must be >= 1")
        if self.rate <= 0:
            raise ValueError("rate must be > 0 sessions/s")

    def params(self) -> AgentParams:
        return AgentParams(
            sessions=self.sessions,
            rate=self.rate,
            turns=TURNS,
            system_prompts=SYSTEM_PROMPTS,
            first_user=USER_TOKENS,
            tool_result=USER_TOKENS,
            output=REPLY_TOKENS,
            tool_time=TOOL_TIME_S,
            max_context_tokens=MAX_CONTEXT_TOKENS,
        )

    def turns(self) -> list[Turn]:
        # Plain text turns: the CPU engines' random model may close a required call early
        # and go on generating, so a call written back in the next turn is not what was
        # generated, which a trained model's is; text replies are written back whole.
        return [replace(t, ended_by=None) for t in generate(self.params(), self.seed)]


def context_tokens(turns: list[Turn]) -> int:
    """Every session's final context together, in stand-in tokens: what a fleet would
    need to hold all of them at once (the KV cache should be smaller)."""
    total = 0
    for turn in turns:
        system = text_tokens(turn.system) if turn.system is not None else 0
        total += system + text_tokens(turn.user) + turn.output_tokens
    return total
