"""WorkerConfig: every setting of the reference worker, validated once at startup.

A bad value raises ``ValueError`` whose message names the command-line flag, so the CLI can exit 2
with it. Derived sizes (pages per pool, ``max_req_input_len``) live here so that the engine, the
admission rule and ``/get_server_info`` all read the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

#: ``prefill`` and ``decode`` are the two halves of disaggregated serving as separate servers behind
#: SGLang's model gateway (``workers.pd_api``); ``disaggregated`` runs both halves in one process.
MODES = ("aggregated", "disaggregated", "prefill", "decode")
PD_MODES = ("prefill", "decode")
# "single" is 0.1's name for the aggregated mode (a word that also named its pool and the monitor's node
# role). It runs until 0.3 refuses it, under 0.1's wire names (mode="single", pool="single"), so that
# dashboards and queries written against them keep working until they move (CHANGELOG.md, "Upgrading
# from 0.1").
DEPRECATED_MODES = {"single": "aggregated"}
UNIFIED_POOL = "unified"
ADMISSIONS = ("reject", "placeholder")
DEVICES = ("cpu", "cuda")
PREFIX_CACHE_MODES = ("off", "shared", "per-tenant")
#: The bug zoo: defects of real engines, each behind ``--bug NAME`` and fixed without it
#: (``docs/architecture.md`` lists them with the cases they follow).
BUGS = (
    "rid-collision",
    "prefix-key-partial",
    "prefix-key-no-adapter",
    "abort-in-flight",
    "session-restore",
    "batch-crossed",
    "slot-stale-tokens",
    "sampling-rows-stale",
    "session-offload-chunks",
    "offload-salt-dropped",
    "salt-body-over-header",
    "pd-transfer-corrupt",
)


@dataclass(frozen=True)
class WorkerConfig:
    """Settings of one worker process; see ``python -m kvcanary.workers --help`` for each flag."""

    host: str = "127.0.0.1"
    port: int = 30000
    device: str = "cpu"
    mode: str = "aggregated"
    admission: str = "reject"
    kv_pool_tokens: int = 4096
    prefill_pool_tokens: int | None = None
    decode_pool_tokens: int | None = None
    page_size: int = 16
    context_window: int = 8192
    max_batch: int = 64
    seed: int = 0
    served_model_name: str = "kvcanary-reference"
    api_keys: dict[str, str] = field(default_factory=dict)
    verify_ownership: bool = False
    zero_freed_pages: bool = False
    prefix_cache: str = "off"
    session_cache: int = 0
    #: vLLM's reasoning end string: forced into an answer once its ``thinking_token_budget`` ran out
    #: (None: budgets are accepted and force nothing).
    reasoning_end_str: str | None = None
    lora_adapters: tuple[str, ...] = ()
    bugs: frozenset[str] = frozenset()
    bug_rate: float = 1.0
    log_level: str = "info"
    #: ``--mode prefill``: where the decode server fetches each room's K/V (on ``host``).
    bootstrap_port: int | None = None
    #: PD modes: how long either side waits for the other in a KV hand-off (SGLang's bootstrap timeout).
    kv_transfer_timeout: float = 30.0
    #: PD modes: an Adler-32 digest of each hand-off's K/V, taken by the prefill server over its pages
    #: and checked by the decode server over what it received (SGLang's
    #: ``--disaggregation-enable-kv-checksum``); a mismatch fails the request closed.
    kv_checksum: bool = False
    #: The header a trusted gateway sets the cache salt in (``x-tenant-id``, as NVIDIA Dynamo reads it;
    #: ``X-Cache-Salt``, as vLLM's pull request #57609 proposes): it wins over the body's ``cache_salt``
    #: (None: the body's alone).
    cache_salt_header: str | None = None
    #: PD modes: data-parallel ranks (SGLang's ``--dp-size`` with DP attention), each an engine with a
    #: KV pool and a batch of its own; ``workers.dp`` says which rank serves a request.
    dp_size: int = 1
    #: Ranks whose pool differs from the others' (``--rank-pool-tokens RANK=TOKENS``): a rank whose
    #: GPU had less memory free when its pool was sized, as SGLang sizes each rank's pool on its own.
    rank_pool_tokens: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        _require(
            self.mode in MODES or self.mode in DEPRECATED_MODES,
            f"--mode must be one of {', '.join(MODES)}, got {self.mode!r}",
        )
        _require(
            self.admission in ADMISSIONS,
            f"--admission must be one of {', '.join(ADMISSIONS)}, got {self.admission!r}",
        )
        _require(
            self.prefix_cache in PREFIX_CACHE_MODES,
            f"--prefix-cache must be one of {', '.join(PREFIX_CACHE_MODES)}, got {self.prefix_cache!r}",
        )
        unknown = sorted(self.bugs - set(BUGS))
        _require(
            not unknown, f"--bug must be one of {', '.join(BUGS)}, got {unknown[0]!r}" if unknown else ""
        )
        for bug in ("prefix-key-partial", "prefix-key-no-adapter"):
            _require(
                bug not in self.bugs or self.prefix_cache != "off",
                f"--bug {bug} needs a prefix cache: add --prefix-cache shared or per-tenant",
            )
        _require(
            "prefix-key-no-adapter" not in self.bugs or bool(self.lora_adapters),
            "--bug prefix-key-no-adapter needs an adapter: add --lora-adapter NAME",
        )
        for name in self.lora_adapters:
            _require(
                bool(name.strip()) and name != self.served_model_name,
                f"--lora-adapter must be a non-empty name other than the served model's, got {name!r}",
            )
        _require(self.session_cache >= 0, f"--session-cache must be 0 or more, got {self.session_cache}")
        self._check_pd_flags()
        self._check_dp_flags()
        _require(
            not self.session_cache or (self.prefix_cache == "off" and self.mode in ("aggregated", "single")),
            "--session-cache needs --mode aggregated and --prefix-cache off (restores are the request's "
            "own writes, never shared pages)",
        )
        for bug in ("session-restore", "session-offload-chunks", "offload-salt-dropped"):
            _require(
                bug not in self.bugs or self.session_cache > 0,
                f"--bug {bug} needs a session cache: add --session-cache N",
            )
        _require(
            "salt-body-over-header" not in self.bugs or self.cache_salt_header is not None,
            "--bug salt-body-over-header needs a salt header: add --cache-salt-header NAME",
        )
        _require(
            self.cache_salt_header is None or _header_name(self.cache_salt_header),
            f"--cache-salt-header must be an HTTP header name, got {self.cache_salt_header!r}",
        )
        _require(
            self.reasoning_end_str is None or bool(self.reasoning_end_str.encode()),
            "--reasoning-end-str must not be empty",
        )
        _require(0.0 < self.bug_rate <= 1.0, f"--bug-rate must be in (0, 1], got {self.bug_rate}")
        _require(self.device in DEVICES, f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        _require(0 <= self.port <= 65535, f"--port must be in 0..65535, got {self.port}")
        _require(self.page_size >= 1, f"--page-size must be at least 1, got {self.page_size}")
        _require(self.context_window >= 2, f"--context-window must be at least 2, got {self.context_window}")
        _require(self.max_batch >= 1, f"--max-batch must be at least 1, got {self.max_batch}")
        _require(bool(self.served_model_name.strip()), "--served-model-name must not be empty")
        for flag, tokens in self._pool_flags().items():
            _require(
                tokens >= 2 * self.page_size,
                f"{flag} must hold at least two pages ({2 * self.page_size} tokens), got {tokens}",
            )
        for key, tenant in self.api_keys.items():
            _require(bool(key) and bool(tenant), "--api-key entries need a non-empty KEY and TENANT")

    def _check_pd_flags(self) -> None:
        """Refuse the flags that make no sense for the prefill or the decode server (or outside them)."""
        if self.mode == "prefill":
            _require(self.bootstrap_port is not None, "--mode prefill needs --bootstrap-port N")
            _require(
                self.decode_pool_tokens is None,
                "--decode-pool-tokens is for --mode decode or disaggregated, not --mode prefill",
            )
        else:
            _require(self.bootstrap_port is None, "--bootstrap-port is for --mode prefill only")
        if self.bootstrap_port is not None:
            _require(
                1 <= self.bootstrap_port <= 65535 and self.bootstrap_port != self.port,
                f"--bootstrap-port must be in 1..65535 and not --port, got {self.bootstrap_port}",
            )
        if self.mode == "decode":
            _require(
                self.prefill_pool_tokens is None,
                "--prefill-pool-tokens is for --mode prefill or disaggregated, not --mode decode",
            )
            _require(
                self.admission == "reject",
                "--admission is the prefill server's: --mode decode takes no --admission placeholder",
            )
            _require(
                self.prefix_cache == "off",
                "--prefix-cache needs a mode that prefills: --mode decode keeps every page its request's own",
            )
        _require(
            not self.kv_checksum or self.mode in PD_MODES,
            "--kv-checksum is for --mode prefill or decode (the hand-off between two servers)",
        )
        _require(
            "pd-transfer-corrupt" not in self.bugs or self.mode == "prefill",
            "--bug pd-transfer-corrupt is the prefill server's: add --mode prefill",
        )
        _require(
            self.kv_transfer_timeout > 0,
            f"--kv-transfer-timeout must be positive, got {self.kv_transfer_timeout}",
        )

    def _check_dp_flags(self) -> None:
        """Refuse data-parallel flags outside the prefill and decode servers, or naming no rank."""
        _require(1 <= self.dp_size <= 64, f"--dp-size must be in 1..64, got {self.dp_size}")
        _require(
            self.dp_size == 1 or self.mode in PD_MODES,
            "--dp-size is for --mode prefill or decode (the ranks of a PD server)",
        )
        ranks = [rank for rank, _ in self.rank_pool_tokens]
        for rank, tokens in self.rank_pool_tokens:
            _require(
                tokens >= 2 * self.page_size,
                f"--rank-pool-tokens {rank}=: a pool holds at least two pages "
                f"({2 * self.page_size} tokens), got {tokens}",
            )
        for rank in ranks:
            last = self.dp_size - 1
            _require(0 <= rank <= last, f"--rank-pool-tokens names rank {rank}; ranks are 0..{last}")
        _require(len(set(ranks)) == len(ranks), "--rank-pool-tokens names a rank twice")
        _require(not ranks or self.dp_size > 1, "--rank-pool-tokens needs --dp-size 2 or more")

    def for_rank(self, rank: int) -> WorkerConfig:
        """Return the settings of data-parallel rank ``rank``: one rank, its own pool."""
        one = replace(self, dp_size=1, rank_pool_tokens=())
        tokens = dict(self.rank_pool_tokens).get(rank)
        if tokens is None:
            return one
        if self.mode == "prefill":
            return replace(one, prefill_pool_tokens=tokens)
        return replace(one, decode_pool_tokens=tokens)

    @property
    def disaggregated(self) -> bool:
        """Return True when prefill and decode have pools of their own in this one process."""
        return self.mode == "disaggregated"

    @property
    def prefills(self) -> bool:
        """Return True when this process prefills through a pool of its own (``prefill`` names it)."""
        return self.mode in ("disaggregated", "prefill")

    @property
    def unified_pool_name(self) -> str:
        """Return the name of the aggregated mode's one pool (0.1's ``single`` under ``--mode single``)."""
        return "single" if self.mode == "single" else UNIFIED_POOL

    def _pool_flags(self) -> dict[str, int]:
        """Return each configured pool size under the flag that set it."""
        if self.mode == "prefill":
            return {"--prefill-pool-tokens": self.prefill_tokens_requested}
        if self.mode == "decode":
            return {"--decode-pool-tokens": self.decode_tokens_requested}
        if not self.disaggregated:
            return {"--kv-pool-tokens": self.kv_pool_tokens}
        return {
            "--prefill-pool-tokens": self.prefill_tokens_requested,
            "--decode-pool-tokens": self.decode_tokens_requested,
        }

    @property
    def prefill_tokens_requested(self) -> int:
        """Return the prefill pool size asked for (``--kv-pool-tokens`` when the flag is absent)."""
        return self.prefill_pool_tokens if self.prefill_pool_tokens is not None else self.kv_pool_tokens

    @property
    def decode_tokens_requested(self) -> int:
        """Return the decode pool size asked for (``--kv-pool-tokens`` when the flag is absent)."""
        return self.decode_pool_tokens if self.decode_pool_tokens is not None else self.kv_pool_tokens

    @property
    def pool_tokens(self) -> dict[str, int]:
        """Return the usable tokens of each pool by name: ``unified``, or ``prefill`` and ``decode``
        (one of them for the prefill or the decode server).

        A pool holds whole pages only, so a size that is not a multiple of ``page_size`` is rounded down.
        """
        if self.mode == "prefill":
            return {"prefill": self._whole_pages(self.prefill_tokens_requested)}
        if self.mode == "decode":
            return {"decode": self._whole_pages(self.decode_tokens_requested)}
        if not self.disaggregated:
            return {self.unified_pool_name: self._whole_pages(self.kv_pool_tokens)}
        return {
            "prefill": self._whole_pages(self.prefill_tokens_requested),
            "decode": self._whole_pages(self.decode_tokens_requested),
        }

    def _whole_pages(self, tokens: int) -> int:
        return tokens // self.page_size * self.page_size

    @property
    def admission_pool_tokens(self) -> int:
        """Return the pool that admission checks: the unified pool, the prefill pool, or on the decode
        server its own pool (the one thing it can check; the prefill server checks its pool)."""
        return self.pool_tokens[self.prompt_pool_name]

    @property
    def prompt_pool_name(self) -> str:
        """Return the name of the pool prompts are computed into (the decode server computes none,
        so its own pool stands in)."""
        if self.prefills:
            return "prefill"
        return "decode" if self.mode == "decode" else self.unified_pool_name

    @property
    def decode_pool_name(self) -> str:
        """Return the name of the pool that decode reads from. The prefill server decodes nothing: its
        running batch, always empty, is built over its prefill pool."""
        if self.mode == "prefill":
            return "prefill"
        return "decode" if self.mode in ("disaggregated", "decode") else self.unified_pool_name

    @property
    def decode_pool_limit(self) -> int | None:
        """Return the tokens of the pool decode preallocates from, None on the prefill server (which
        cannot know the decode server's pool)."""
        return None if self.mode == "prefill" else self.pool_tokens[self.decode_pool_name]

    @property
    def prefix_cache_pool_name(self) -> str | None:
        """Return the pool whose full prompt pages the prefix cache reuses (None with the cache off).

        Aggregated mode caches in its one pool; disaggregated mode in the prefill pool, whose pages only
        live until their transfer, so the decode pool keeps every page exclusive to its request.
        """
        if self.prefix_cache == "off":
            return None
        return self.prompt_pool_name

    @property
    def cache_tiers(self) -> tuple[str, ...]:
        """Return the tiers that may serve a prompt's K/V, nearest first: the prefix cache's pages
        (``prefix``), or the session cache's host ring (``session``) and its offload tier (``offload``)."""
        if self.prefix_cache != "off":
            return ("prefix",)
        return ("session", "offload") if self.session_cache else ()

    @property
    def max_req_input_len(self) -> int:
        """Return the longest prompt admitted: ``min(context_window, admission pool) - 1``.

        SGLang subtracts a few more tokens of headroom; one is enough here because the worker
        reserves decode pages separately (see ``workers.admission``).
        """
        return min(self.context_window, self.admission_pool_tokens) - 1

    @property
    def effective_admission(self) -> str:
        """Return the admission behaviour in force: the prefill side's choice (in-process or a prefill
        server); aggregated mode always rejects, as SGLang's non-PD, and a decode server never
        substitutes (prefill does)."""
        return self.admission if self.prefills else "reject"

    @property
    def context_exceeds_pool(self) -> bool:
        """Return True for the incident's misconfiguration: a context window the pool cannot hold."""
        return self.context_window > self.admission_pool_tokens


def _header_name(name: str) -> bool:
    """Return True for a valid HTTP header name (RFC 9110's token characters) that is not one the
    worker reads for something else."""
    allowed = set("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    return bool(name) and set(name) <= allowed and name.lower() not in ("authorization", "x-request-id")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
