"""CopyModel: positional keys separate every position, generation copies the KV it is given."""

from __future__ import annotations

import math

import torch

from kvcanary.workers.kv_cache import PagePool
from kvcanary.workers.model import ATTENTION_SCALE, HEAD_DIM, CopyModel, DecodeStep


def test_it_separates_every_position_under_two_to_the_twenty() -> None:
    model = CopyModel(device="cpu")
    freqs = model._freqs  # the definition of the code: q_t . k_p = mean(cos(freqs * (t - p)))
    worst = 0.0
    for start in range(1, 1 << 20, 1 << 17):
        distance = torch.arange(start, min(start + (1 << 17), 1 << 20), dtype=torch.float64)
        worst = max(worst, torch.cos(distance[:, None] * freqs[None, :]).mean(dim=1).max().item())
    assert worst < 0.7
    # 8192 positions each at most exp(-scale * gap) of the peak: the softmax is one-hot in float32.
    assert 8192 * math.exp(-ATTENTION_SCALE * (1 - worst)) < 1e-20


def test_it_makes_unit_keys_from_positions() -> None:
    code = CopyModel(device="cpu").positional_code(torch.arange(5))
    assert code.shape == (5, HEAD_DIM)
    assert torch.allclose(code.norm(dim=1), torch.ones(5))


def generate(
    model: CopyModel, pool: PagePool, pages: list[int], decode_len: int, steps: int, rid: int
) -> list[int]:
    """Decode ``steps`` tokens for one request whose block table is ``pages``."""
    out: list[int] = []
    for t in range(steps):
        seq = decode_len + t
        if out:
            position = seq - 1
            page, slot = pages[position // pool.page_size], position % pool.page_size
            writes = [page, slot, position, out[-1], rid, 1]
        else:
            writes = []
        w = torch.tensor(writes, dtype=torch.int64).view(6, len(writes) // 6)
        step = DecodeStep(
            block_tables=torch.tensor([pages]),
            seq_lens=torch.tensor([seq]),
            query_positions=torch.tensor([t]),
            write_pages=w[0],
            write_slots=w[1],
            write_positions=w[2],
            write_tokens=w[3],
            write_request_ids=w[4],
            write_tenants=w[5],
        )
        out.append(int(model.decode(pool, step).item()))
    return out


def make_pool() -> PagePool:
    return PagePool(name="t", num_pages=64, page_size=16, head_dim=HEAD_DIM, device="cpu")


def test_it_echoes_its_prompt_bit_for_bit_every_time() -> None:
    prompt = list("Échos: the quick brown fox jumps over the lazy dog. 0123456789".encode())
    outputs = []
    for _ in range(2):
        model, pool = CopyModel(device="cpu", seed=3), make_pool()
        pages = pool.alloc(8, request_id=1)
        model.prefill(pool, pages, prompt, request_id=1, tenant_index=1)
        outputs.append(generate(model, pool, pages, len(prompt), len(prompt), rid=1))
    assert outputs[0] == outputs[1] == prompt


def test_it_emits_whoever_wrote_the_pages_it_is_pointed_at() -> None:
    model, pool = CopyModel(device="cpu"), make_pool()
    secret = list(b"tenant A wrote this, and only tenant A should read it")
    pages = pool.alloc(4, request_id=1)
    model.prefill(pool, pages, secret, request_id=1, tenant_index=1)
    pool.free(pages)
    stale = pool.alloc(8, request_id=2)  # LIFO: A's pages first, in A's order
    model.prefill(pool, stale, [0], request_id=2, tenant_index=2)  # the one-token placeholder
    out = generate(model, pool, stale, decode_len=64, steps=len(secret), rid=2)
    assert bytes(out[1:]) == bytes(secret[1:])
