"""CopyModel: a tiny deterministic attention model whose output is read OUT OF its KV cache.

Tokens are bytes (vocabulary 256). Every position ``p`` gets a key ``code(p)``, a unit vector of 32
seeded sinusoid pairs computed in float64 and cast to float32; every token ``x`` gets the value
``E[x]``, a seeded random unit vector. Decode step ``t`` of a request queries ``code(t)``: the dot
product peaks at 1 for ``p == t`` and stays below about 0.6 elsewhere for any position under 2**20
(``tests/workers/test_model.py`` checks the margin), and the scale of 256 turns that gap into a
one-hot softmax. The attended value is therefore ``E[token at position t]``, and projecting onto
``E`` and taking the argmax returns that token.

So generation COPIES whatever sequence the request's block table points at, from position 0: a
healthy request echoes its own prompt, and a request whose pages hold someone else's stale K/V
emits that someone else's text. There are no weights to download and no sampling; outputs are
bit-for-bit repeatable, and the margins are wide enough for any float32 device to agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvcanary.workers.kv_cache import SCRATCH_PAGE, PagePool

HEAD_DIM = 64
VOCAB_SIZE = 256
ATTENTION_SCALE = 256.0
# The positional code is part of the model's definition, not of --seed: its separation margin is
# verified for this seed only.
_POSITION_SEED = 20260706


@dataclass
class DecodeStep:
    """Device tensors for one batched decode step over ``B`` running requests.

    Row ``b`` attends positions ``[0, seq_lens[b])`` through ``block_tables[b]`` (padded with the
    scratch page) and queries position ``query_positions[b]``. The ``write_*`` vectors (length
    ``W <= B``) carry the newest token of each request that has one; it is written before attention.
    With ownership verification, ``expected_words`` (``[B, P]``) is the ownership word each
    block-table entry must hold (see ``entries_owned``). ``allowed_tokens`` (``[B, VOCAB_SIZE]``,
    True where allowed) limits what each row may be given (a request's ``allowed_token_ids``).
    """

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_positions: torch.Tensor
    write_pages: torch.Tensor
    write_slots: torch.Tensor
    write_positions: torch.Tensor
    write_tokens: torch.Tensor
    write_request_ids: torch.Tensor
    write_tenants: torch.Tensor
    expected_words: torch.Tensor | None = None
    allowed_tokens: torch.Tensor | None = None


class CopyModel:
    """The model: positional keys, embedding values, greedy decoding over paged K/V."""

    def __init__(
        self, *, device: torch.device | str, seed: int = 0, ownership_shortcut: bool = False
    ) -> None:
        self.device = torch.device(device)
        positions_rng = torch.Generator().manual_seed(_POSITION_SEED)
        freqs = 0.3 + torch.rand(HEAD_DIM // 2, generator=positions_rng, dtype=torch.float64) * (
            math.pi - 0.6
        )
        self._freqs = freqs.to(self.device)
        values_rng = torch.Generator().manual_seed(seed)
        embedding = torch.randn(VOCAB_SIZE, HEAD_DIM, generator=values_rng, dtype=torch.float64)
        embedding /= embedding.norm(dim=1, keepdim=True)
        self.embedding = embedding.to(torch.float32).to(self.device)
        self._embedding_t = self.embedding.t().contiguous()
        # The gathered K/V are the big per-step temporaries (16 MB each at 32 x 2048 tokens). Reusing
        # their storage stops malloc from mapping and unmapping them every step, which cost about a
        # third of the CPU step time in page faults. Only the engine thread decodes.
        self._gathered_keys = torch.empty(0, device=self.device)
        self._gathered_values = torch.empty(0, device=self.device)
        # Ownership check shortcut (see entries_owned): sound anywhere, cheap only without a device sync.
        self.ownership_shortcut = ownership_shortcut

    def positional_code(self, positions: torch.Tensor) -> torch.Tensor:
        """Return unit keys ``[N, HEAD_DIM]`` (float32) for int positions ``[N]``, computed in float64."""
        angles = positions.to(torch.float64)[:, None] * self._freqs[None, :]
        code = torch.cat([torch.cos(angles), torch.sin(angles)], dim=1) / math.sqrt(HEAD_DIM // 2)
        return code.to(torch.float32)

    def prefill(
        self,
        pool: PagePool,
        pages: list[int],
        token_ids: list[int],
        *,
        request_id: int,
        tenant_index: int,
        start: int = 0,
    ) -> None:
        """Compute K/V of prompt positions ``[start, len(token_ids))`` at once and write them through
        ``pages`` (the whole prompt's block table).

        ``start`` is a page boundary: the pages before it hold cached K/V and are neither computed nor
        touched. Raises ``ValueError`` otherwise.
        """
        if start % pool.page_size:
            raise ValueError(f"prefill must start on a page boundary, got position {start}")
        ids = torch.tensor(token_ids[start:], dtype=torch.int64, device=self.device)
        positions = torch.arange(start, len(token_ids), device=self.device)
        pool.write_prefix(
            pages[start // pool.page_size :],
            self.positional_code(positions),
            self.embedding[ids],
            request_id=request_id,
            tenant_index=tenant_index,
        )

    def write_newest(self, pool: PagePool, step: DecodeStep) -> None:
        """Write the K/V of each request's newest token into its page and tag the page as written."""
        if step.write_pages.numel() == 0:
            return
        flat = step.write_pages * pool.page_size + step.write_slots
        pool.k.view(-1, HEAD_DIM).index_copy_(0, flat, self.positional_code(step.write_positions))
        pool.v.view(-1, HEAD_DIM).index_copy_(0, flat, self.embedding[step.write_tokens])
        pool.record_write(
            step.write_pages,
            step.write_slots,
            step.write_slots + 1,
            request_id=step.write_request_ids,
            tenant_index=step.write_tenants,
        )

    def attend(
        self,
        pool: PagePool,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_positions: torch.Tensor,
        allowed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Return the greedy next token ``[B]`` of every row: one batched attention over gathered pages,
        the argmax taken over the tokens ``allowed`` leaves each row (all when None)."""
        batch, num_pages = block_tables.shape
        span = num_pages * pool.page_size
        flat_pages = block_tables.reshape(-1)
        shape = (flat_pages.numel(), pool.page_size, HEAD_DIM)
        keys = torch.index_select(pool.k, 0, flat_pages, out=self._gathered_keys.resize_(shape))
        values = torch.index_select(pool.v, 0, flat_pages, out=self._gathered_values.resize_(shape))
        keys, values = keys.view(batch, span, HEAD_DIM), values.view(batch, span, HEAD_DIM)
        query = self.positional_code(query_positions) * ATTENTION_SCALE
        scores = torch.bmm(keys, query.unsqueeze(2)).squeeze(2)
        beyond = torch.arange(span, device=self.device)[None, :] >= seq_lens[:, None]
        scores.masked_fill_(beyond, float("-inf"))
        weights = torch.softmax(scores, dim=1)
        context = torch.bmm(weights.unsqueeze(1), values).squeeze(1)
        logits = context @ self._embedding_t
        if allowed is not None:
            logits = logits.masked_fill(~allowed, float("-inf"))
        return logits.argmax(dim=1)

    def decode(self, pool: PagePool, step: DecodeStep) -> torch.Tensor:
        """Run one decode step; return next tokens ``[B]`` on the device, ``-1`` for an ownership violation.

        When the step carries expected ownership words, every block-table entry that fails the
        check is replaced by the scratch page BEFORE the gather, so a foreign page is never read, and
        the token of a row with any failing entry is replaced by -1. Tokens and violation flags thus
        come back to the host in one transfer.
        """
        self.write_newest(pool, step)
        allowed = step.allowed_tokens
        if step.expected_words is None:
            return self.attend(pool, step.block_tables, step.seq_lens, step.query_positions, allowed)
        # attend copies the table view to a contiguous one anyway: copying first speeds up the check.
        tables = step.block_tables.contiguous()
        entry_ok = entries_owned(pool, tables, step.expected_words, shortcut=self.ownership_shortcut)
        if entry_ok is None:
            return self.attend(pool, tables, step.seq_lens, step.query_positions, allowed)
        safe_tables = torch.where(entry_ok, tables, SCRATCH_PAGE)
        tokens = self.attend(pool, safe_tables, step.seq_lens, step.query_positions, allowed)
        return torch.where(entry_ok.all(dim=1), tokens, -1)


def entries_owned(
    pool: PagePool, block_tables: torch.Tensor, expected_words: torch.Tensor, *, shortcut: bool
) -> torch.Tensor | None:
    """Return ``[B, P]`` bool: each block-table entry's ownership word is exactly the one its row expects.

    With ``word(request, filled) = request * (page_size + 1) + filled``, a page row ``r`` reads in
    slots ``[0, n)`` must hold ``word(r, n)``: the request itself wrote exactly those slots (a lost
    write leaves ``filled`` short, another writer changes the request). A page allocated ahead must
    still hold the word it had when the request joined, and scratch padding 0 (see
    ``workers.batch``). Exactness makes the check one comparison, and it also catches a write into
    a page the request has not reached yet while that page is in the step's view (outside it, the
    request overwrites each slot before reading it, so a foreign write there is never read).

    With ``shortcut`` (the CPU, where reading a result costs no device sync) return None when every
    entry passes: one whole-batch comparison then replaces the per-entry mask in the common case.
    Without it (CUDA) the check stays branch-free and its flags ride along with the sampled tokens.
    """
    # index_select over the flat (contiguous) table: the same gather as torch.take, cheaper per call.
    words = pool.ownership.index_select(0, block_tables.reshape(-1)).view(block_tables.shape)
    if shortcut and torch.equal(words, expected_words):
        return None
    return words == expected_words
