"""Admission: decide, before any KV is computed, what the worker will do with a prompt.

Rules, in order (``L`` = prompt tokens, ``C`` = context window, ``M`` = ``config.max_req_input_len``,
which is ``min(C, admission pool) - 1``; the admission pool is the unified pool or the prefill pool):

1. ``L >= C``: reject, reason ``context_window``, with SGLang's tokenizer-manager wording.
2. ``L > M``: the request cannot fit the admission pool.
   - ``--admission reject`` (the fix, and always in aggregated mode): reject, reason ``kv_capacity``,
     with SGLang's scheduler wording, before any KV transfer.
   - ``--admission placeholder`` in disaggregated mode (THE DEFECT, as in sgl-project/sglang#30233):
     replace the input by the one-token placeholder ``[0]``. Prefill computes and transfers one token
     while decode still believes the sequence is ``L`` tokens long and preallocates pages for it.
3. Disaggregated only: ``L`` larger than the decode pool can ever hold (``decode pool - 1``) is
   rejected ``kv_capacity`` in both admission modes. A prefill server (``--mode prefill``) skips this
   rule, since the decode pool is another server's; a decode server (``--mode decode``) plans with
   rules 1 and 3 on its own pool and never substitutes: the prefill server decides, and the decode
   server decodes the length it believes, whatever prefill transferred (``workers.pd_serving``).

Generation budget: ``min(max_tokens, L, C - L)`` new tokens (the echo is complete after ``L``), and
decode reserves ``min(L + budget, decode pool)`` tokens of pages up front; when a reservation is
clamped by the pool, generation stops early with ``finish_reason = "length"``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcanary.workers.config import WorkerConfig

PLACEHOLDER_INPUT = (0,)


class AdmissionRejected(Exception):
    """The request is refused with HTTP 400; ``reason`` is the bounded metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class AdmissionPlan:
    """What the worker will really do with an admitted prompt.

    ``input_ids`` are the tokens prefill computes and transfers (``[0]`` for a placeholder);
    ``decode_len`` is the sequence length decode believes it holds (always the original length).
    """

    input_ids: tuple[int, ...]
    decode_len: int
    max_new_tokens: int
    reserve_tokens: int
    placeholder: bool

    @property
    def prompt_tokens(self) -> int:
        """Return the tokens really prefilled: what ``usage.prompt_tokens`` reports."""
        return len(self.input_ids)


def plan_admission(config: WorkerConfig, prompt_ids: list[int], max_tokens: int) -> AdmissionPlan:
    """Return the plan for ``prompt_ids``; raise ``AdmissionRejected`` when the request must get a 400."""
    length = len(prompt_ids)
    if length >= config.context_window:
        raise AdmissionRejected(
            "context_window",
            f"The input ({length} tokens) is longer than the model's context length "
            f"({config.context_window} tokens).",
        )
    placeholder = False
    if length > config.max_req_input_len:
        if config.effective_admission != "placeholder":
            raise _over_capacity(length, config.max_req_input_len)
        placeholder = True
    budget = min(max_tokens, length, config.context_window - length)
    # The prefill server cannot know the decode server's pool: the decode server checks its own.
    decode_pool = config.decode_pool_limit or length + budget
    if length > decode_pool - 1:
        raise _over_capacity(length, decode_pool - 1)
    return AdmissionPlan(
        input_ids=PLACEHOLDER_INPUT if placeholder else tuple(prompt_ids),
        decode_len=length,
        max_new_tokens=budget,
        reserve_tokens=min(length + budget, decode_pool),
        placeholder=placeholder,
    )


def _over_capacity(length: int, limit: int) -> AdmissionRejected:
    return AdmissionRejected(
        "kv_capacity",
        f"Input length ({length} tokens) exceeds the maximum allowed length ({limit} tokens).",
    )
