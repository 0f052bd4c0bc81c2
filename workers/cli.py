"""``python -m kvcanary.workers``: parse flags into a WorkerConfig and serve it.

A bad flag value exits 2 with a message naming the flag (argparse's convention).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from kvcanary.workers.auth import load_keys_file, parse_key_spec
from kvcanary.workers.config import (
    ADMISSIONS,
    BUGS,
    DEPRECATED_MODES,
    MODES,
    PREFIX_CACHE_MODES,
    WorkerConfig,
)

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def build_parser() -> argparse.ArgumentParser:
    """Return the parser; every flag carries a help string."""
    parser = argparse.ArgumentParser(
        prog="python -m kvcanary.workers",
        description="kvcanary reference serving worker: a paged-KV copy model behind an OpenAI API. "
        "It reproduces the disaggregated placeholder leak (--mode disaggregated --admission placeholder), "
        "its fix (--admission reject) and owner-verified pages (--verify-ownership).",
    )
    _add_serving_flags(parser.add_argument_group("serving"))
    _add_cache_flags(parser.add_argument_group("KV cache and admission"))
    _add_isolation_flags(parser.add_argument_group("isolation"))
    return parser


def _add_serving_flags(group: argparse._ArgumentGroup) -> None:
    add = group.add_argument
    add("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    add("--port", type=int, default=30000, help="TCP port to bind (default: %(default)s)")
    add("--device", default=None, help="torch device, cpu or cuda (default: cuda when available)")
    add(
        "--served-model-name",
        default="kvcanary-reference",
        help="model name clients must send (default: %(default)s)",
    )
    add("--max-batch", type=int, default=64, help="most requests decoding together (default: %(default)s)")
    add("--seed", type=int, default=0, help="seed of the model's token embeddings (default: %(default)s)")
    add(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY=TENANT",
        help="accept bearer KEY as TENANT (repeatable); with no keys every request is accepted and "
        "its bearer token (or 'anonymous') names its tenant",
    )
    add(
        "--api-keys-file",
        metavar="PATH",
        help="file of KEY=TENANT lines (# comments allowed), added to --api-key",
    )
    add(
        "--log-level",
        choices=LOG_LEVELS,
        default="info",
        help="log level of worker and uvicorn (default: %(default)s)",
    )


def _add_cache_flags(group: argparse._ArgumentGroup) -> None:
    add = group.add_argument
    add(
        "--mode",
        choices=[*MODES, *DEPRECATED_MODES],
        default="aggregated",
        help="aggregated: one unified KV pool for prefill and decode; disaggregated: a pool each, in "
        "this one process; prefill or decode: one half of disaggregated serving as its own server, "
        "behind SGLang's model gateway (--pd-disaggregation), the K/V handed over a socket "
        "(default: %(default)s; 'single' is 0.1's deprecated name for aggregated)",
    )
    add(
        "--bootstrap-port",
        type=int,
        metavar="N",
        help="--mode prefill: the port (on --host) where decode servers fetch each request's K/V; "
        "give the gateway the same number (--prefill URL N)",
    )
    add(
        "--kv-transfer-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="--mode prefill/decode: seconds either side waits for the other's K/V hand-off before "
        "failing the request with HTTP 500 (default: %(default)s)",
    )
    add(
        "--kv-checksum",
        action="store_true",
        help="--mode prefill/decode: an Adler-32 digest of each hand-off's K/V, taken by the prefill "
        "server over its pages and checked by the decode server over what it received; a mismatch "
        "fails the request with HTTP 500 and is counted (SGLang's --disaggregation-enable-kv-checksum; "
        "turn it on on both servers)",
    )
    add(
        "--admission",
        choices=ADMISSIONS,
        default="reject",
        help="disaggregated or prefill mode: reject over-capacity prompts with HTTP 400 (the fix), or "
        "replace them by a one-token placeholder that decodes over stale pages (the defect of "
        "sgl-project/sglang#30233); "
        "aggregated mode always rejects (default: %(default)s)",
    )
    add(
        "--kv-pool-tokens",
        type=int,
        default=4096,
        help="tokens of the unified pool; in disaggregated mode the size of each pool whose own flag is "
        "absent (default: %(default)s)",
    )
    add(
        "--prefill-pool-tokens",
        type=int,
        help="prefill pool tokens, which admission checks (disaggregated or prefill mode; "
        "default: --kv-pool-tokens)",
    )
    add(
        "--decode-pool-tokens",
        type=int,
        help="decode pool tokens (disaggregated or decode mode; default: --kv-pool-tokens)",
    )
    add(
        "--dp-size",
        type=int,
        default=1,
        help="--mode prefill/decode: data-parallel ranks, each with a KV pool and a batch of its own; a "
        "request's routed_dp_rank (or data_parallel_rank) picks its rank, else its bootstrap room "
        "modulo the ranks on a prefill server, else the next rank in turn (default: %(default)s)",
    )
    add(
        "--rank-pool-tokens",
        action="append",
        default=[],
        metavar="RANK=TOKENS",
        help="with --dp-size: the pool of one rank whose GPU had less memory free (repeatable; the "
        "others take the mode's pool flag)",
    )
    add("--page-size", type=int, default=16, help="tokens per KV page (default: %(default)s)")
    add(
        "--context-window",
        type=int,
        default=8192,
        help="advertised context window in tokens; it may exceed the pool (the incident's "
        "misconfiguration, logged as a warning) (default: %(default)s)",
    )


def _add_isolation_flags(group: argparse._ArgumentGroup) -> None:
    add = group.add_argument
    add(
        "--verify-ownership",
        action="store_true",
        help="verify before each decode read that every page attended is owned and filled by the "
        "request; fail closed with HTTP 500 otherwise",
    )
    add(
        "--zero-freed-pages",
        action="store_true",
        help="zero K/V and clear owner tags of pages when they are freed",
    )
    add(
        "--prefix-cache",
        choices=PREFIX_CACHE_MODES,
        default="off",
        help="reuse full KV pages of earlier prompts: 'shared' lets every tenant hit every tenant's "
        "pages (the finding a cross-tenant audit must detect), 'per-tenant' salts every page with the "
        "tenant of the API key (the fix); a request's cache_salt applies in both (default: %(default)s)",
    )
    add(
        "--lora-adapter",
        action="append",
        default=[],
        metavar="NAME",
        help="serve NAME as a LoRA adapter of the model, as vLLM's --lora-modules (repeatable): its "
        "own model name and its own prefix-cache domain (the copy model's weights do not change, so "
        "only cache keys tell adapters apart)",
    )
    add(
        "--session-cache",
        type=int,
        default=0,
        metavar="N",
        help="keep the K/V of the last N finished sequences in host memory and restore a returning "
        "conversation's from it, as llama.cpp's --cache-ram (aggregated mode, prefix cache off; "
        "default: %(default)s, off)",
    )
    add(
        "--cache-salt-header",
        default=None,
        metavar="NAME",
        help="take the cache salt from header NAME too, as a gateway sets it for the tenant it "
        "authenticated (NVIDIA Dynamo reads x-tenant-id); the header wins over the body's cache_salt "
        "(default: none, the body's alone)",
    )
    add(
        "--reasoning-end-str",
        default=None,
        metavar="TEXT",
        help="the reasoning end string, as vLLM's reasoning configuration names it: forced into an "
        "answer once the request's thinking_token_budget ran out (default: none; budgets force nothing)",
    )
    add(
        "--bug-rate",
        type=float,
        default=1.0,
        metavar="P",
        help="make each --bug fire on a fraction P of its trigger events, drawn from --seed "
        "(default: %(default)s, every one)",
    )
    add(
        "--bug",
        action="append",
        choices=BUGS,
        default=[],
        metavar="NAME",
        help="turn on a defect of a real engine, implemented in the engine (repeatable; "
        "docs/architecture.md lists each with the real cases it follows): "
        "'rid-collision' routes output by the client's request id (sglang#24223); "
        "'prefix-key-partial' keys prefix-cache pages by the prompt's first pages only (llama.cpp#27422); "
        "'prefix-key-no-adapter' leaves the LoRA adapter out of them (vllm#44701); "
        "'abort-in-flight' lets a hung-up request decode on and hands its output to the next request "
        "(redis-py#2624, the 2023 ChatGPT incident); 'session-restore' leaves a reused session-cache "
        "slot's old entry visible, so a returning conversation gets another one's K/V (llama.cpp#27148); "
        "'batch-crossed' hands each row of a full, mixed batch another row's tokens (vllm#5607, mlx-lm#965); "
        "'slot-stale-tokens' prefills a request that takes a slot freed while the batch ran from the "
        "previous occupant's tokens (vLLM GHSA-v97p-wpxp-px84); 'sampling-rows-stale' reads a moved "
        "row's sampling parameters (allowed tokens, stop strings, thinking budget) from the table entry "
        "at its row, not its slot (vLLM GHSA-fpch-3xrf-7q96, CVE-2026-114049); 'session-offload-chunks' "
        "keys the session cache's offload tier by chunk position only, so a conversation back after the "
        "ring moved on is restored from the latest long sequence (LMCache#4385, llama.cpp#27148); "
        "'offload-salt-dropped' leaves the cache salt out of the offload tier's keys, so another salt's "
        "sequence is restored from it (LMCache#4825, LMCache#3008); 'salt-body-over-header' lets the "
        "body's cache_salt win over --cache-salt-header's, so a client picks its cache domain "
        "(dynamo#14803); 'pd-transfer-corrupt' flips bytes of the K/V a prefill server hands over "
        "(sglang#39229)",
    )


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    """Return the WorkerConfig of parsed ``args``; raise ``ValueError`` naming the bad flag."""
    keys = load_keys_file(args.api_keys_file) if args.api_keys_file else {}
    for spec in args.api_key:
        key, tenant = parse_key_spec(spec, source="--api-key")
        keys[key] = tenant
    device = args.device or _default_device()
    if device == "cuda" and not _cuda_available():
        raise ValueError("--device cuda: CUDA is not available on this machine")
    return WorkerConfig(
        host=args.host,
        port=args.port,
        device=device,
        mode=args.mode,
        admission=args.admission,
        kv_pool_tokens=args.kv_pool_tokens,
        prefill_pool_tokens=args.prefill_pool_tokens,
        decode_pool_tokens=args.decode_pool_tokens,
        page_size=args.page_size,
        context_window=args.context_window,
        max_batch=args.max_batch,
        seed=args.seed,
        served_model_name=args.served_model_name,
        api_keys=keys,
        verify_ownership=args.verify_ownership,
        zero_freed_pages=args.zero_freed_pages,
        prefix_cache=args.prefix_cache,
        session_cache=args.session_cache,
        reasoning_end_str=args.reasoning_end_str,
        lora_adapters=tuple(args.lora_adapter),
        bug_rate=args.bug_rate,
        bugs=frozenset(args.bug),
        log_level=args.log_level,
        bootstrap_port=args.bootstrap_port,
        kv_transfer_timeout=args.kv_transfer_timeout,
        kv_checksum=args.kv_checksum,
        cache_salt_header=args.cache_salt_header,
        dp_size=args.dp_size,
        rank_pool_tokens=tuple(_rank_pool(spec) for spec in args.rank_pool_tokens),
    )


def _rank_pool(spec: str) -> tuple[int, int]:
    """Parse one ``--rank-pool-tokens RANK=TOKENS``; raise ``ValueError`` naming the flag."""
    rank, sep, tokens = spec.partition("=")
    if not sep or not rank.strip().isdigit() or not tokens.strip().isdigit():
        raise ValueError(f"--rank-pool-tokens takes RANK=TOKENS (two whole numbers), got {spec!r}")
    return int(rank), int(tokens)


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and serve; return the exit status (2 for a bad flag, via argparse)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from kvcanary.workers.server import serve

    serve(config)
    return 0
