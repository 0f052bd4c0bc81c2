"""KV transfer between the prefill and the decode pool, driven by an explicit manifest.

In disaggregated serving prefill and decode are separate pools (separate nodes in SGLang PD): prefill
computes K/V into its own pages, the transfer copies exactly ``num_tokens`` positions into pages that
decode preallocated, and only then does prefill free its pages. The manifest is the whole contract
of the handoff, so the defect is visible in it: a placeholder request's manifest says
``num_tokens = 1`` while decode preallocated pages for the full original length. The prefill and
decode servers (``--mode prefill``/``decode``) hand the same manifest over a socket
(``workers.pd_transfer``): the prefill side reads its rows, the decode side writes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcanary.workers.kv_cache import PagePool


@dataclass(frozen=True)
class TransferManifest:
    """One handoff: positions ``[0, num_tokens)`` from ``src_pages`` (prefill) to ``dst_pages`` (decode)."""

    request_id: int
    tenant: str
    num_tokens: int
    src_pages: tuple[int, ...]
    dst_pages: tuple[int, ...]


def transfer_kv(manifest: TransferManifest, src: PagePool, dst: PagePool, *, tenant_index: int) -> None:
    """Copy the manifest's positions from ``src`` into ``dst`` and tag the written decode pages.

    Only those positions are written: the rest of the destination pages keep whatever they held.
    Raises ``ValueError`` when the manifest's pages cannot hold ``num_tokens``.
    """
    if src.page_size != dst.page_size:
        raise ValueError("prefill and decode pools must share a page size")
    if len(manifest.src_pages) < src.pages_for(manifest.num_tokens):
        raise ValueError(
            f"manifest of request {manifest.request_id} has too few pages for {manifest.num_tokens}"
        )
    k, v = read_positions(src, manifest.src_pages, manifest.num_tokens)
    write_positions(dst, manifest, k, v, tenant_index=tenant_index)


def read_positions(
    pool: PagePool, pages: Sequence[int], num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the K and V rows (``[num_tokens, head_dim]`` each) of positions ``[0, num_tokens)``."""
    slots = pool.slot_index(list(pages), num_tokens)
    head_dim = pool.head_dim
    return pool.k.view(-1, head_dim)[slots], pool.v.view(-1, head_dim)[slots]


def write_positions(
    dst: PagePool, manifest: TransferManifest, k: torch.Tensor, v: torch.Tensor, *, tenant_index: int
) -> None:
    """Write ``k`` and ``v`` at positions ``[0, num_tokens)`` of the manifest's decode pages and tag
    them as the manifest's request wrote them; the rest of the pages keep whatever they held (the
    decode server receives the rows over a socket, ``workers.pd_transfer``, and writes them here).

    Raises ``ValueError`` when the pages cannot hold ``num_tokens`` or the rows are not that many.
    """
    num_tokens = manifest.num_tokens
    if len(manifest.dst_pages) < dst.pages_for(num_tokens):
        raise ValueError(f"manifest of request {manifest.request_id} has too few pages for {num_tokens}")
    if k.shape != (num_tokens, dst.head_dim) or v.shape != k.shape:
        raise ValueError(f"request {manifest.request_id}: K/V rows shaped {tuple(k.shape)}, not {num_tokens}")
    slots = dst.slot_index(list(manifest.dst_pages), num_tokens)
    dst.k.view(-1, dst.head_dim)[slots] = k.to(dst.device)
    dst.v.view(-1, dst.head_dim)[slots] = v.to(dst.device)
    dst.record_prefix_write(
        list(manifest.dst_pages), num_tokens, request_id=manifest.request_id, tenant_index=tenant_index
    )
