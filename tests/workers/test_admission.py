"""Admission rules: context window, KV capacity, the placeholder defect, generation budgets."""

from __future__ import annotations

import pytest

from kvcanary.workers.admission import AdmissionRejected, plan_admission
from tests.workers.support import small_config

PROMPT = list(range(1, 101)) * 15  # 1500 tokens: inside the 8192 context, over the 1024 prefill pool


def test_it_rejects_a_prompt_at_or_over_the_context_window_with_sglang_wording() -> None:
    with pytest.raises(AdmissionRejected) as rejected:
        plan_admission(small_config(), [1] * 8192, 16)
    assert rejected.value.reason == "context_window"
    assert (
        rejected.value.message
        == "The input (8192 tokens) is longer than the model's context length (8192 tokens)."
    )


def test_it_rejects_a_prompt_over_the_pool_in_aggregated_mode() -> None:
    with pytest.raises(AdmissionRejected) as rejected:
        plan_admission(small_config(mode="aggregated", admission="placeholder"), PROMPT, 16)
    assert rejected.value.reason == "kv_capacity"
    assert (
        rejected.value.message
        == "Input length (1500 tokens) exceeds the maximum allowed length (1023 tokens)."
    )


def test_it_rejects_a_prompt_over_the_prefill_pool_when_admission_rejects() -> None:
    with pytest.raises(AdmissionRejected, match="exceeds the maximum allowed length"):
        plan_admission(small_config(mode="disaggregated", admission="reject"), PROMPT, 16)


def test_it_substitutes_the_one_token_placeholder_when_admission_is_defective() -> None:
    plan = plan_admission(small_config(mode="disaggregated", admission="placeholder"), PROMPT, 200)
    assert plan.placeholder
    assert plan.input_ids == (0,)
    assert plan.prompt_tokens == 1
    assert plan.decode_len == 1500  # decode still believes the original length...
    assert plan.reserve_tokens == 1700  # ...and preallocates for it


def test_it_rejects_even_a_placeholder_that_the_decode_pool_could_never_hold() -> None:
    config = small_config(mode="disaggregated", admission="placeholder", decode_pool_tokens=1024)
    with pytest.raises(AdmissionRejected, match=r"maximum allowed length \(1023 tokens\)"):
        plan_admission(config, PROMPT, 16)


def test_it_budgets_one_echo_of_the_prompt_at_most() -> None:
    plan = plan_admission(small_config(), [7] * 10, 500)
    assert (plan.max_new_tokens, plan.reserve_tokens, plan.placeholder) == (10, 20, False)


def test_it_caps_the_budget_by_the_context_window_and_the_reservation_by_the_pool() -> None:
    plan = plan_admission(small_config(kv_pool_tokens=1024, context_window=1030), [7] * 1000, 500)
    assert plan.max_new_tokens == 30
    assert plan.reserve_tokens == 1024
