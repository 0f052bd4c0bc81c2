"""KV transfer between the prefill and the decode pool, driven by an explicit manifest.

In disaggregated serving prefill and decode are separate pools (separate nodes in SGLang PD): prefill
computes K/V into its own pages, the transfer copies exactly ``num_tokens`` positions into pages that
decode preallocated, and only then does prefill free its pages. The manifest is the whole contract
of the handoff, so the defect is visible in it: a placeholder request's manifest says
``num_tokens = 1`` while decode preallocated pages for the full original length.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.kv_cache import PagePool


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
    needed = dst.pages_for(manifest.num_tokens)
    if len(manifest.src_pages) < needed or len(manifest.dst_pages) < needed:
        raise ValueError(
            f"manifest of request {manifest.request_id} has too few pages for {manifest.num_tokens}"
        )
    src_slots = src.slot_index(list(manifest.src_pages), manifest.num_tokens)
    dst_slots = dst.slot_index(list(manifest.dst_pages), manifest.num_tokens)
    head_dim = dst.head_dim
    dst.k.view(-1, head_dim)[dst_slots] = src.k.view(-1, head_dim)[src_slots]
    dst.v.view(-1, head_dim)[dst_slots] = src.v.view(-1, head_dim)[src_slots]
    dst.record_prefix_write(
        list(manifest.dst_pages),
        manifest.num_tokens,
        request_id=manifest.request_id,
        tenant_index=tenant_index,
    )
