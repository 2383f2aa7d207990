"""The router's configuration schema: typed, frozen dataclasses with their defaults, each
checking its own values when built; an error names the field
(``upstream.connect_timeout_s: must be > 0``). Loading it from a file, the environment
and flags, and checking the policy, is ``router.config_loader``'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from router.errors import ConfigError
from router.wire.blocks import DEFAULT_BLOCK_TOKENS
from router.wire.sessions import DEFAULT_SESSION_KEYS, parse_source

DEFAULT_PORT = 8000
# A worker's circuit breaker (router.fleet.breaker): opened after this many consecutive
# failures, for a cooldown that doubles on each failed trial up to the maximum.
DEFAULT_FAILURE_THRESHOLD = 5
DEFAULT_COOLDOWN_S = 2.0
DEFAULT_MAX_COOLDOWN_S = 60.0
DEFAULT_POLICY = "ttft"
# 256 bytes of canonical prompt ~ 64 tokens at ~4 bytes a token: four of the engines'
# 16-token blocks. Matching is then exact to within 64 tokens (under 1% of an agent
# turn's context) while a 100K-token prompt is ~1,600 hashes instead of ~6,250.
DEFAULT_BLOCK_BYTES = 256
BYTES_PER_TOKEN_ESTIMATE = 4
# Keyed by the engine's tokens, a router block is a run of an engine's blocks' tokens:
# 16 divides every block size vLLM uses (16 on GPU by default, multiples of 32 on CPU).
DEFAULT_KEY_BLOCK_TOKENS = DEFAULT_BLOCK_TOKENS
# A 1M-token context is about 4 MB of text.
DEFAULT_MAX_TOKENIZED_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
# The parser walks every message and content part in Python on the event loop, so their
# counts, not the body size, bound how long it holds the loop: 32 MiB holds over a million
# empty messages. 10,000 messages of 100 tokens each fill a 1M-token context.
DEFAULT_MAX_MESSAGES = 10_000
DEFAULT_MAX_CONTENT_PARTS = 10_000  # over all of a request's messages
# Session keys are kept as 128-bit digests; the cap makes a mistaken key (a whole prompt
# in ``user``) a clear 400 rather than a silently distinct session.
DEFAULT_MAX_SESSION_KEY_BYTES = 1024
DEFAULT_KEEPALIVE_TIMEOUT_S = 75.0
DEFAULT_BODY_TIMEOUT_S = 60.0
DEFAULT_WRITE_TIMEOUT_S = 60.0
DEFAULT_KV_TOKENS = 400_000  # ~ Llama-3.1-8B on one H100 at utilization 0.9


KV_EVENT_SCHEMES = ("tcp://", "ipc://")
HOST_PLACEHOLDER = "{host}"


def check_kv_endpoint(template: str, where: str) -> None:
    """A ZMQ endpoint to connect to, ``{host}`` standing for the worker's host."""
    if not template.startswith(KV_EVENT_SCHEMES):
        raise ConfigError(f"{where}: {template!r} is not a tcp:// or ipc:// endpoint")
    try:
        template.format(host="h")
    except (KeyError, IndexError, ValueError):
        raise ConfigError(
            f"{where}: {template!r} may hold {HOST_PLACEHOLDER} and nothing else"
        ) from None
    if template.startswith("tcp://") and "*" in template:
        raise ConfigError(f"{where}: {template!r} binds; the router connects to the engine's")


@dataclass(frozen=True, slots=True)
class KvEventsEndpoints:
    """Where one worker's engine publishes its KV events (vLLM's --kv-events-config
    ``endpoint`` and ``replay_endpoint``, as the router reaches them)."""

    endpoint: str
    replay_endpoint: str = ""  # empty: a gap cannot be replayed, the worker is rebuilt

    def __post_init__(self) -> None:
        check_kv_endpoint(self.endpoint, "endpoint")
        if self.replay_endpoint:
            check_kv_endpoint(self.replay_endpoint, "replay_endpoint")


# A worker's name is a label value, a log field and part of what replicas share in Redis
# (a stored response's owner): a host:port or a pod's name, never more than this.
MAX_WORKER_NAME = 512


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    url: str
    name: str = ""  # default: host:port of the url
    kv_tokens: int | None = None  # default: capacity.kv_tokens or computed
    kv_events: KvEventsEndpoints | None = None  # default: kv_events' templates
    # Its engine's CPU tier in tokens, modelled while it is approximate (default:
    # offload.tier_tokens); an exact worker's engine announces its own.
    offload_tokens: int | None = None

    def __post_init__(self) -> None:
        try:
            parts = urlsplit(self.url)
        except ValueError:  # e.g. an unclosed IPv6 bracket
            raise ConfigError(f"url: {self.url!r} is not an http(s) URL") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"url: {self.url!r} is not an http(s) URL")
        try:
            parts.port  # noqa: B018  (urlsplit checks the port only when asked)
        except ValueError:
            raise ConfigError(f"url: {self.url!r} has no valid port") from None
        if not self.name:
            object.__setattr__(self, "name", parts.netloc)
        if len(self.name) > MAX_WORKER_NAME or any(
            c.isspace() or not c.isprintable() for c in self.name
        ):
            raise ConfigError(
                f"name: {self.name[:80]!r} must be at most {MAX_WORKER_NAME} printable "
                "characters without spaces"
            )
        if self.kv_tokens is not None and self.kv_tokens < 1:
            raise ConfigError("kv_tokens: must be >= 1")
        if self.offload_tokens is not None and self.offload_tokens < 0:
            raise ConfigError("offload_tokens: must be >= 0")


CONTENT_FORMATS = ("auto", "string", "openai")


ENGINE_TOKENIZER = "engine"  # prefix.tokenizer: ask the workers


@dataclass(frozen=True, slots=True)
class PrefixConfig:
    # Bytes of canonical prompt a block (text mode); by tokens, 4 bytes a token. None:
    # 256 by text; by tokens 16 tokens, a whole number of which makes any engine's block.
    block_bytes: int | None = None
    record_replies: bool = True  # extend a session's prefix with the streamed reply
    # A model directory (tokenizer.json, tokenizer_config.json): prompts keyed by the
    # model's own tokens, 4 bytes each, so block_bytes / 4 tokens a block
    # (router/tokens); "engine": the ids from a worker's POST /tokenize. None: by text.
    tokenizer: str | None = None
    engine_timeout_s: float = 2.0  # tokenizer: engine; a slower answer keys by text
    # How messages' content reaches the template (vLLM's --chat-template-content-format).
    content_format: str = "auto"
    # Earlier prompts' ids kept to encode less; each prompt is also charged for its
    # bookkeeping (router.tokens.incremental's PROMPT_OVERHEAD_TOKENS).
    tokenizer_cache_tokens: int = 16_000_000
    # A request body larger than this is keyed by its text, not tokenized: the tokenizer's
    # work for one request, and what it can hold the event loop for, is bounded.
    max_tokenized_bytes: int = DEFAULT_MAX_TOKENIZED_BYTES

    def __post_init__(self) -> None:
        if self.block_bytes is not None and not 16 <= self.block_bytes <= 65536:
            raise ConfigError("block_bytes: must be between 16 and 65536")
        if self.tokenizer is not None and self.key_block_bytes % BYTES_PER_TOKEN_ESTIMATE:
            raise ConfigError(
                "block_bytes: with tokenizer, a whole number of tokens "
                f"({BYTES_PER_TOKEN_ESTIMATE} bytes each; 64 for the engine's 16-token blocks)"
            )
        if self.content_format not in CONTENT_FORMATS:
            raise ConfigError(f"content_format: one of {', '.join(CONTENT_FORMATS)}")
        if self.tokenizer_cache_tokens < 0:
            raise ConfigError("tokenizer_cache_tokens: must be >= 0")
        if self.max_tokenized_bytes < 1024:
            raise ConfigError("max_tokenized_bytes: must be >= 1024")
        if self.engine_timeout_s <= 0:
            raise ConfigError("engine_timeout_s: must be > 0")

    @property
    def key_block_bytes(self) -> int:
        """The bytes of a prompt's key a block holds (4 a token when keyed by tokens)."""
        if self.block_bytes is not None:
            return self.block_bytes
        if self.tokenizer is not None:
            return DEFAULT_KEY_BLOCK_TOKENS * BYTES_PER_TOKEN_ESTIMATE
        return DEFAULT_BLOCK_BYTES

    @property
    def block_tokens(self) -> int:
        return max(1, self.key_block_bytes // BYTES_PER_TOKEN_ESTIMATE)


@dataclass(frozen=True, slots=True)
class CapacityConfig:
    """Each worker's KV capacity, for the residency model.

    ``kv_tokens`` when given; else computed from ``model`` and ``gpu`` with the capacity
    math (``kvrouter capacity``); else ``DEFAULT_KV_TOKENS``.
    """

    kv_tokens: int | None = None
    model: str | None = None  # preset name or config.json path
    gpu: str | None = None
    gpus_per_worker: int = 1
    gpu_memory_utilization: float = 0.9
    kv_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.kv_tokens is not None and self.kv_tokens < 1:
            raise ConfigError("kv_tokens: must be >= 1")
        if (self.model is None) != (self.gpu is None):
            raise ConfigError("model, gpu: give both or neither")
        if self.gpus_per_worker < 1:
            raise ConfigError("gpus_per_worker: must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("gpu_memory_utilization: must be in (0, 1]")


@dataclass(frozen=True, slots=True)
class UpstreamConfig:
    # A new connection to a worker (not the wait for a free pooled one: that is load).
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0  # longest silence between two chunks of a response
    # A streamed request whose worker sends nothing for this long (its prefill, queue
    # included) counts as the worker's failure and is retried elsewhere if the retry
    # deadline allows. A non-streamed reply arrives whole after its generation, so only
    # read_timeout_s bounds it.
    first_byte_timeout_s: float = 60.0
    max_connections: int = 2048
    max_connections_per_worker: int = 512
    max_attempts: int = 2  # tries on distinct workers before the first byte
    # No retry starts this long after the request arrived (a client's patience); longer
    # than first_byte_timeout_s, so that a worker that hangs costs a retry.
    retry_deadline_s: float = 90.0
    # Before the next worker is tried: 0 at once, else this, doubling with each failure.
    retry_backoff_s: float = 0.0
    # Engines started with --api-key: sent as "Authorization: Bearer <key>" on every
    # request, probe and scrape the router makes of them (never the client's own).
    api_key: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        for name in (
            "connect_timeout_s",
            "read_timeout_s",
            "first_byte_timeout_s",
            "retry_deadline_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be > 0")
        if not 0 <= self.retry_backoff_s <= self.retry_deadline_s:
            raise ConfigError("retry_backoff_s: must be >= 0 and <= retry_deadline_s")
        for name in ("max_connections", "max_connections_per_worker", "max_attempts"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1")

    @property
    def auth_headers(self) -> dict[str, str]:
        """What authenticates the router to its engines (nothing without an api_key)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True, slots=True)
class HealthConfig:
    interval_s: float = 5.0
    timeout_s: float = 2.0
    # Engine /metrics reads (load, restarts); a worker whose metrics are older than
    # stale_after_s counts as saturated: chosen only when every worker is.
    scrape_interval_s: float = 1.0
    stale_after_s: float = 10.0
    # Circuit breaker (router/fleet/breaker.py): consecutive upstream failures that open it,
    # and how long it stays open before one trial request (doubling up to the max).
    failure_threshold: int = DEFAULT_FAILURE_THRESHOLD
    cooldown_s: float = DEFAULT_COOLDOWN_S
    max_cooldown_s: float = DEFAULT_MAX_COOLDOWN_S

    def __post_init__(self) -> None:
        if min(self.interval_s, self.timeout_s, self.scrape_interval_s) <= 0:
            raise ConfigError("interval_s, timeout_s, scrape_interval_s: must be > 0")
        if self.stale_after_s <= self.scrape_interval_s:
            raise ConfigError("stale_after_s: must be longer than scrape_interval_s")
        if self.failure_threshold < 1:
            raise ConfigError("failure_threshold: must be >= 1")
        if not 0 < self.cooldown_s <= self.max_cooldown_s:
            raise ConfigError("cooldown_s: must be > 0 and <= max_cooldown_s")


@dataclass(frozen=True, slots=True)
class KubernetesConfig:
    """EndpointSlices by label selector (router/discovery/kubernetes.py); empty selector: off."""

    selector: str = ""  # e.g. "app=vllm"
    namespace: str = ""  # default: the pod's own
    port_name: str = ""  # default: the slice's first port
    api_url: str = ""  # default: https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT
    token_file: str = "/var/run/secrets/kubernetes.io/serviceaccount/token"
    ca_file: str = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"


@dataclass(frozen=True, slots=True)
class DiscoveryConfig:
    """Workers beyond the static list (router/discovery/reconciler.py); empty: static only."""

    file: str = ""  # a YAML/JSON list of workers, re-read when it changes
    dns: str = ""  # A/AAAA records of a name, or SRV records of a _service._proto name
    dns_port: int = 8000  # for A/AAAA records (SRV records carry their own)
    dns_nameserver: str = ""  # host:port; default: the system's resolvers
    kubernetes: KubernetesConfig = field(default_factory=KubernetesConfig)
    interval_s: float = 5.0

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise ConfigError("interval_s: must be > 0")
        if not 0 < self.dns_port <= 65535:
            raise ConfigError("dns_port: must be 1-65535")


PRIORITIES = ("interactive", "batch")  # the queue's classes, first served first
MAX_RETRY_AFTER_S = 60.0  # the longest wait a shed request is told


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """The router's queue (``router.routing.queue``): a request whose chosen worker is
    full waits at the router, where it can be ordered by what is cached and moved to
    another worker, instead of in the engine's first-come queue. A worker is full when
    it has ``max_queued_prefill_s`` of uncached prefill waiting (at its learned speed),
    when the prompts it is running would pass ``kv_budget`` of its KV capacity, or at
    ``max_outstanding_per_worker`` requests (0: no such ceiling). A held request that
    cannot start within its class's deadline is shed: 429 (Anthropic's API: 529) with
    ``Retry-After``. ``enabled: false``: every request goes straight to its worker."""

    enabled: bool = False
    max_outstanding_per_worker: int = 0
    max_queued_prefill_s: float = 1.0
    kv_budget: float = 1.0
    queue_size: int = 1024  # held requests, all classes
    queue_bytes: int = 256 * 1024 * 1024  # their bodies
    queue_timeout_s: float = 10.0  # the interactive class's deadline
    # A session's first turn (no reply in it: nothing cached, no work invested) is shed
    # sooner, so that under overload new sessions wait at the door rather than sessions
    # already under way failing in the middle.
    first_turn_queue_timeout_s: float = 2.0
    # Sessions' first turns wait while any turn of a session under way is held: the fleet
    # is full for the sessions it has, and a new one would bring dozens of turns more.
    door: bool = True
    # ... and stays closed while at least this share of the turns of sessions under way
    # in the last door_window_s had to wait (1: never on that account). A turn waiting
    # now and then (a long context for a worker busy with another) leaves it open; a
    # fleet where most wait is full for the sessions it has.
    door_pressure: float = 1.0
    door_window_s: float = 30.0
    batch_queue_timeout_s: float = 60.0
    # The least wait a shed request is told (retry-after-ms; Retry-After is whole seconds,
    # at least 1), when what is held could start sooner: clients sent back sooner would
    # find the queue as full.
    min_retry_after_s: float = 1.0
    # The first-token target of interactive requests (0: none). A held interactive request
    # is shed as soon as it could no longer start in time to meet it: once it has waited
    # the target less its own prefill (at its worker's learned speed). One whose prefill
    # alone takes longer cannot meet it anyway and keeps its class's deadline.
    ttft_target_s: float = 0.0
    # A held request's prefill counts this many seconds less for each second it has
    # waited, so that a long fresh prompt is not passed over for ever.
    ageing: float = 1.0
    # Client keys (from api_keys) whose requests are batch; a request may also lower
    # itself to batch with X-Kvrouter-Priority: batch.
    batch_api_keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        checks = (
            (self.max_outstanding_per_worker >= 0, "max_outstanding_per_worker: must be >= 0"),
            (self.max_queued_prefill_s > 0, "max_queued_prefill_s: must be > 0"),
            (0 < self.kv_budget <= 1, "kv_budget: must be in (0, 1]"),
            (self.queue_size >= 0, "queue_size: must be >= 0"),
            (self.queue_bytes >= 0, "queue_bytes: must be >= 0"),
            (self.queue_timeout_s > 0, "queue_timeout_s: must be > 0"),
            (self.first_turn_queue_timeout_s > 0, "first_turn_queue_timeout_s: must be > 0"),
            (self.batch_queue_timeout_s > 0, "batch_queue_timeout_s: must be > 0"),
            (self.ageing >= 0, "ageing: must be >= 0"),
            (self.ttft_target_s >= 0, "ttft_target_s: must be >= 0 (0: none)"),
            (0 < self.door_pressure <= 1, "door_pressure: must be in (0, 1]"),
            (self.door_window_s > 0, "door_window_s: must be > 0"),
            (
                0 < self.min_retry_after_s <= MAX_RETRY_AFTER_S,
                f"min_retry_after_s: must be in (0, {MAX_RETRY_AFTER_S:g}]",
            ),
            (
                all(
                    math.isfinite(v)
                    for v in (
                        self.max_queued_prefill_s,
                        self.queue_timeout_s,
                        self.first_turn_queue_timeout_s,
                        self.batch_queue_timeout_s,
                        self.ttft_target_s,
                        self.door_window_s,
                        self.min_retry_after_s,
                        self.ageing,
                    )
                ),
                "admission: times and ageing must be finite",
            ),
        )
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    def deadline_s(self, priority: str, first_turn: bool = False) -> float:
        if priority == "batch":
            return self.batch_queue_timeout_s
        return (
            min(self.first_turn_queue_timeout_s, self.queue_timeout_s)
            if first_turn
            else (self.queue_timeout_s)
        )

    def target_slack_s(self, priority: str, prefill_s: float) -> float | None:
        """How long a request whose own prefill takes ``prefill_s`` may wait and still
        meet ``ttft_target_s``; None: no target applies (none set, batch, or the prefill
        alone misses it)."""
        if self.ttft_target_s <= 0 or priority == "batch" or prefill_s >= self.ttft_target_s:
            return None
        return self.ttft_target_s - prefill_s


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """How long the router waits on its own clients (aiohttp bounds neither by default
    in a way that frees a connection soon: keep-alive 3630 s, a request body forever)."""

    # A connection with no request in progress (idle between requests, or still sending
    # its request line and headers) is closed this long after it opened or its last
    # response ended. Longer than the 60 s idle timeout of common load balancers, so that
    # it is they who close idle connections, never the router under them.
    keepalive_timeout_s: float = DEFAULT_KEEPALIVE_TIMEOUT_S
    # A request's whole body must arrive within this long after its headers; else 408,
    # and the connection is closed (32 MiB in 60 s is 4.5 Mbit/s).
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    # A client that reads nothing of its answer for this long (the router's writes held
    # back) is cut off, and its request ends on the worker: else it holds the request,
    # and the engine's KV for it, for as long as it keeps the connection open.
    write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S

    def __post_init__(self) -> None:
        for name in ("keepalive_timeout_s", "body_timeout_s", "write_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be > 0")


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What one client request may carry besides ``max_body_bytes``; above a limit the
    request gets a 400 ``invalid_request_error`` naming the parameter."""

    max_messages: int = DEFAULT_MAX_MESSAGES
    max_content_parts: int = DEFAULT_MAX_CONTENT_PARTS
    max_session_key_bytes: int = DEFAULT_MAX_SESSION_KEY_BYTES

    def __post_init__(self) -> None:
        for name in ("max_messages", "max_content_parts", "max_session_key_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1")


@dataclass(frozen=True, slots=True)
class StateConfig:
    """Shared state across router replicas (``url`` empty: in-process only).

    ``redis://``, ``rediss://``, ``redis+sentinel://host:port/service_name`` and
    ``redis+cluster://host:port`` are accepted.
    """

    url: str = ""
    namespace: str = "kvrouter"
    flush_interval_s: float = 0.02  # how long index writes wait to be batched
    # How often replicas share their load (queued prefill included) and rates: often
    # enough that a prefill queued by another replica is seen while it is queued.
    load_interval_s: float = 0.1
    key_ttl_s: float = 3600.0  # residency keys of a worker nobody touches expire
    # Changes stay on the stream this long: live replicas read them within milliseconds;
    # a starting replica reads the residency sets instead. Events carry every block hash
    # of a prompt (8 bytes each), so the stream is bounded by time, not by count.
    stream_retention_s: float = 30.0
    # Read-your-writes across replicas (router/replication/path.py): a request whose
    # session history no local worker holds asks Redis which worker does; the decision
    # is written to Redis before forwarding and the reply's blocks before the final
    # chunk. Each such round trip waits at most path_timeout_s, then the request goes
    # on, on local state.
    read_your_writes: bool = True
    path_timeout_s: float = 0.005

    def __post_init__(self) -> None:
        if self.url and not self.url.startswith(
            ("redis://", "rediss://", "unix://", "redis+sentinel://", "redis+cluster://")
        ):
            raise ConfigError(
                "url: expected redis://, rediss://, unix://, redis+sentinel:// or redis+cluster://"
            )
        for name in (
            "flush_interval_s",
            "load_interval_s",
            "key_ttl_s",
            "stream_retention_s",
            "path_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be > 0")


DEFAULT_SPECULATIVE_TTL_S = 5.0
DEFAULT_REPLAY_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class KvEventsConfig:
    """Exact mode (router/kv_events/): subscribe to each worker's KV events.

    ``endpoint`` and ``replay_endpoint`` are templates, ``{host}`` the worker's host
    (``tcp://{host}:5557``); ``workers[].kv_events`` overrides them for one worker. A
    worker runs ``data_parallel_size`` engines, rank r publishing on port + r, as vLLM's
    data-parallel ranks do. Exact mode keys prompts by the engine's tokens, so it needs
    ``prefix.tokenizer``; each engine block must be a whole number of the router's
    (``router.index.engine_blocks``), or the worker stays approximate.
    """

    endpoint: str = ""  # empty: no subscriptions but workers' own
    replay_endpoint: str = ""
    topic: str = ""  # vLLM's kv-events-config topic (a prefix filter)
    data_parallel_size: int = 1
    # A block a request computed counts as held this long before the engine announces it.
    speculative_ttl_s: float = DEFAULT_SPECULATIVE_TTL_S
    # How long a replay may go silent before the worker is rebuilt from events instead.
    replay_timeout_s: float = DEFAULT_REPLAY_TIMEOUT_S
    # Count as cached only what the requests queued ahead will not evict (ExactResidency).
    forecast_queue_evictions: bool = False

    def __post_init__(self) -> None:
        if self.endpoint:
            check_kv_endpoint(self.endpoint, "endpoint")
        elif self.replay_endpoint:
            raise ConfigError("replay_endpoint: set endpoint too")
        if self.replay_endpoint:
            check_kv_endpoint(self.replay_endpoint, "replay_endpoint")
        if not 1 <= self.data_parallel_size <= 1024:
            raise ConfigError("data_parallel_size: must be 1-1024")
        for name in ("speculative_ttl_s", "replay_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be > 0")


@dataclass(frozen=True, slots=True)
class OffloadConfig:
    """What reading a prefix back from an engine's CPU tier costs, so that a hit there
    is priced by its reload: tokens x KV bytes per token / the host link's speed.

    ``kv_bytes_per_token``: the engines' (0: from ``capacity.model`` and
    ``capacity.kv_dtype`` with the capacity math; with neither, a CPU-tier hit is not
    credited at all). ``link_gbps``: GB/s one GPU reads host memory at (None: PCIe Gen5
    x16's effective rate, the capacity planner's); a worker of
    ``capacity.gpus_per_worker`` GPUs reads its tier that many times as fast.
    ``tier_tokens``: each engine's CPU tier in tokens (its ``--kv-offloading-size`` over
    the KV bytes per token), modelled for a worker whose engine does not announce it
    (approximate mode): every block it computes written through to an LRU of that size;
    0: none modelled.
    """

    kv_bytes_per_token: int = 0
    link_gbps: float | None = None
    tier_tokens: int = 0

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token < 0:
            raise ConfigError("kv_bytes_per_token: must be >= 0")
        if self.tier_tokens < 0:
            raise ConfigError("tier_tokens: must be >= 0")
        if self.link_gbps is not None and not self.link_gbps > 0:
            raise ConfigError("link_gbps: must be > 0")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    workers: tuple[WorkerConfig, ...] = ()
    host: str = "0.0.0.0"
    port: int = DEFAULT_PORT
    # Processes serving the port together (router/processes/): one is the single-process
    # router; more share the prefix index and load as replicas do, through state.url or,
    # without one, a Valkey the router starts for itself.
    processes: int = 1
    policy: str = DEFAULT_POLICY
    policy_knobs: dict[str, Any] = field(default_factory=dict)
    prefix: PrefixConfig = field(default_factory=PrefixConfig)
    capacity: CapacityConfig = field(default_factory=CapacityConfig)
    upstream: UpstreamConfig = field(default_factory=UpstreamConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    state: StateConfig = field(default_factory=StateConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    kv_events: KvEventsConfig = field(default_factory=KvEventsConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    limits: RequestLimits = field(default_factory=RequestLimits)
    clients: ClientConfig = field(default_factory=ClientConfig)
    # Where a request's session key is read, in order; the first the request carries
    # wins (router.wire.sessions): "header:NAME", "body:FIELD" or "api".
    session_keys: tuple[str, ...] = DEFAULT_SESSION_KEYS
    seed: int | None = None
    admin_token: str = ""  # enables the admin API (router/edge/admin.py) when set
    # Bearer tokens clients must present on /v1/ (empty: no client authentication).
    # KVROUTER_API_KEYS=key1,key2 sets them without putting them in a file.
    api_keys: tuple[str, ...] = ()
    log_requests: bool = False  # one JSON line per request on kvrouter.requests
    # X-Kvrouter-Worker on responses (which worker served). With prefix routing it tells
    # a client whether someone else's prompt is cached where its own went, so it is off
    # unless asked for (benchmarks and debugging: --worker-header).
    worker_header: bool = False
    # When set, GET /metrics wants "Authorization: Bearer <metrics_token>" (Prometheus:
    # the scrape config's authorization.credentials); /metrics is otherwise open.
    metrics_token: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError("port: must be 0-65535")
        if self.processes < 1:
            raise ConfigError("processes: must be >= 1")
        if self.max_body_bytes < 1024:
            raise ConfigError("max_body_bytes: must be >= 1024")
        names = [w.name for w in self.workers]
        duplicate = next((n for n in names if names.count(n) > 1), None)
        if duplicate:
            raise ConfigError(f"workers: two workers are named {duplicate!r}")
        self._check_session_keys()
        if not set(self.admission.batch_api_keys) <= set(self.api_keys):
            raise ConfigError("admission.batch_api_keys: every key must be one of api_keys")
        if self.subscribes_kv_events and self.prefix.tokenizer is None:
            raise ConfigError(
                "kv_events: exact mode keys prompts by the engine's tokens; set prefix.tokenizer"
            )

    def _check_session_keys(self) -> None:
        labels = []
        for text in self.session_keys:
            try:
                labels.append(parse_source(text).label)
            except ValueError as exc:
                raise ConfigError(f"session_keys: {exc}") from None
        repeated = next((label for label in labels if labels.count(label) > 1), None)
        if repeated:
            raise ConfigError(f"session_keys: {repeated!r} is listed twice")

    @property
    def subscribes_kv_events(self) -> bool:
        """Some worker's KV events are to be read (exact mode)."""
        return bool(self.kv_events.endpoint) or any(w.kv_events for w in self.workers)
