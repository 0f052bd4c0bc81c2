"""The known-defects data file and its rules: validation naming the entry and key, versions, matching."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import packaging.version
import pytest
import yaml

from kvcanary.probes.defects import (
    DEFECTS_FILE,
    Catalogue,
    DefectsFileError,
    Specifier,
    Version,
    VersionError,
    load_defects,
    matching,
    node_version,
    shipped,
)

PD_DEFECT = "sglang-pd-placeholder-30233"
ENTRY: dict[str, Any] = {
    "id": "vllm-example-1",
    "engine": "vllm",
    "affected": ">=0.4.0,<0.9.0",
    "requires": {"enable_prefix_caching": [True]},
    "fixed_in": "0.9.0",
    "severity": "high",
    "summary": "An example",
    "references": ["https://example.org/advisory"],
}


def write(tmp_path: Path, *entries: dict[str, Any]) -> Path:
    path = tmp_path / "defects.yml"
    path.write_text(yaml.safe_dump({"defects": list(entries)}))
    return path


def catalogue(tmp_path: Path, *entries: dict[str, Any]) -> Catalogue:
    return load_defects(write(tmp_path, *entries))


# --- the shipped file -----------------------------------------------------------------------------


def test_every_entry_of_the_shipped_file_validates() -> None:
    raw = yaml.safe_load(DEFECTS_FILE.read_text())
    loaded = load_defects()
    assert [d.id for d in loaded.defects] == [entry["id"] for entry in raw["defects"]]
    assert len(loaded.ids) == len(loaded.defects) >= 3
    for defect in loaded.defects:
        assert defect.fixed_in is None or not defect.specifier.contains(Version.parse(defect.fixed_in))
    assert shipped().ids == loaded.ids


def test_the_incident_defect_is_in_the_shipped_file_as_the_disclosure_states() -> None:
    [defect] = [d for d in shipped().defects if d.id == PD_DEFECT]
    assert (defect.engine, defect.affected, defect.fixed_in) == ("sglang", "<0.5.22", "0.5.22")
    assert defect.requires == {"disaggregation_mode": ["prefill", "decode"]}
    assert defect.references[0] == "https://github.com/sgl-project/sglang/issues/30233"


def test_the_header_names_every_key_an_entry_takes() -> None:
    header = DEFECTS_FILE.read_text().split("\ndefects:")[0]
    for key in ENTRY:
        assert re.search(rf"^#   {key}\s", header, re.MULTILINE), key


# --- bad entries are refused, naming the entry and the key ----------------------------------------


def _without(key: str) -> dict[str, Any]:
    entry = copy.deepcopy(ENTRY)
    del entry[key]
    return entry


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({**ENTRY, "colour": "red"}, "defect vllm-example-1: colour: Extra inputs are not permitted"),
        (
            {**ENTRY, "affected": "<<0.9"},
            "defect vllm-example-1: affected: clause '<<0.9': '<0.9' is not a PEP 440",
        ),
        ({**ENTRY, "affected": "~=0.9"}, "defect vllm-example-1: affected: clause '~=0.9'"),
        ({**ENTRY, "affected": "<0.9.*"}, "affected: clause '<0.9.*': '0.9.*' is not a PEP 440 version"),
        ({**ENTRY, "affected": "<0.9+cpu"}, "affected: clause '<0.9+cpu' names a local build"),
        ({**ENTRY, "engine": "tgi", "id": "tgi-x-1"}, "defect tgi-x-1: engine: Input should be 'sglang'"),
        (_without("references"), "defect vllm-example-1: references: Field required"),
        ({**ENTRY, "references": []}, "defect vllm-example-1: references: List should have at least 1 item"),
        (
            {**ENTRY, "references": ["see the issue"]},
            "defect vllm-example-1: references: ['see the issue'] are not https URLs",
        ),
        (_without("fixed_in"), "defect vllm-example-1: fixed_in: Field required"),
        ({**ENTRY, "fixed_in": 0.9}, "defect vllm-example-1: fixed_in: Input should be a valid string"),
        ({**ENTRY, "fixed_in": "0.8.1"}, "defect vllm-example-1: fixed_in: 0.8.1 is inside affected"),
        (
            {**ENTRY, "id": "sglang-example-1"},
            "defect sglang-example-1: id: must start with its engine (vllm-)",
        ),
        (
            {**ENTRY, "requires": {"enable_prefix_caching": []}},
            "requires: ['enable_prefix_caching'] list no accepted value",
        ),
        ({**ENTRY, "requires": {"x": [[1]]}}, "defect vllm-example-1: requires.x.0"),
        ({**ENTRY, "severity": "low"}, "defect vllm-example-1: severity: Input should be 'critical'"),
        ({**ENTRY, "summary": "two\nlines"}, "defect vllm-example-1: summary: String should match pattern"),
        ({**ENTRY, "id": 7}, "defect #1: id: Input should be a valid string"),
    ],
    ids=lambda v: None if isinstance(v, dict) else v[:40],
)
def test_a_bad_entry_is_refused_naming_its_id_and_key(
    tmp_path: Path, entry: dict[str, Any], message: str
) -> None:
    with pytest.raises(DefectsFileError, match=re.escape(message)):
        catalogue(tmp_path, entry)


def test_an_id_given_twice_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DefectsFileError, match="defect vllm-example-1: id: given to two entries"):
        catalogue(tmp_path, ENTRY, ENTRY)


def test_a_key_given_twice_is_refused_not_silently_overwritten(tmp_path: Path) -> None:
    text = yaml.safe_dump({"defects": [ENTRY]}, sort_keys=False).replace(
        "  affected:", "  affected: <0.1\n  affected:"
    )
    path = tmp_path / "defects.yml"
    path.write_text(text)
    expected = f"{path}: defects[0].affected: key given twice, at lines 4 and 5"
    with pytest.raises(DefectsFileError, match=f"^{re.escape(expected)}$"):
        load_defects(path)


@pytest.mark.parametrize("text", ["- a list", "defects: {}", "defects: []\nextra: 1", "defects: [", ""])
def test_a_file_of_the_wrong_shape_is_refused(tmp_path: Path, text: str) -> None:
    path = tmp_path / "defects.yml"
    path.write_text(text)
    with pytest.raises(DefectsFileError, match=re.escape(str(path))):
        load_defects(path)


def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DefectsFileError, match="cannot read"):
        load_defects(tmp_path / "absent.yml")


# --- versions -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lower", "higher"),
    [
        ("0.5.9", "0.5.22"),
        ("0.9.0rc1", "0.9.0"),
        ("0.9.0", "0.9.0.post1"),
        ("1.0.dev1", "1.0a1"),
        ("1.0a1", "1.0b1"),
        ("1.0b2", "1.0rc1"),
        ("1.0rc1.dev3", "1.0rc1"),
        ("1.0", "1.0.post1.dev1"),
        ("1.0.post1.dev1", "1.0.post1"),
        ("0.5.12", "0.5.12.post1"),
        ("0.0.0.dev123", "0.0.1"),
        ("0.9", "0.9.0.1"),
    ],
)
def test_versions_order_as_pep_440_does(lower: str, higher: str) -> None:
    assert Version.parse(lower) < Version.parse(higher)
    assert Version.parse(higher) > Version.parse(lower)


def test_versions_sort_as_pep_440_lists_them() -> None:
    """PEP 440's own example of the order of every kind of suffix (its local entry aside: ignored).

    The hand-written parser that ``packaging`` replaced got it right as well; a text comparison
    would not (``1.0a2.dev456 < 1.0a12.dev456``, ``1.0.post456 < 1.0.15``).
    """
    ordered = [
        "1.dev0",
        "1.0.dev456",
        "1.0a1",
        "1.0a2.dev456",
        "1.0a12.dev456",
        "1.0a12",
        "1.0b1.dev456",
        "1.0b2",
        "1.0b2.post345.dev456",
        "1.0b2.post345",
        "1.0rc1.dev456",
        "1.0rc1",
        "1.0",
        "1.0.post456.dev34",
        "1.0.post456",
        "1.0.15",
        "1.1.dev1",
    ]
    assert sorted(reversed(ordered), key=Version.parse) == ordered
    assert sorted(ordered, key=packaging.version.Version) == ordered


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ("0.9", "0.9.0"),
        ("0.32.0+cpu", "0.32.0"),
        ("1.0RC1", "1.0rc1"),
        ("v1.0", "1.0"),
        ("1.0-1", "1.0.post1"),
    ],
)
def test_versions_equal_up_to_zeros_case_and_local_part(one: str, other: str) -> None:
    assert Version.parse(one) == Version.parse(other)
    assert hash(Version.parse(one)) == hash(Version.parse(other))


@pytest.mark.parametrize(
    "text",
    # "\u0661.\u0662" is 1.2 in Arabic-Indic digits: the hand-written parser took any Unicode digit.
    [
        "",
        "banana",
        "1.0!",
        "1!2.0",
        "0!1.0",
        "0.9.*",
        "b1-0c1e570",
        "b4567",
        "unknown",
        "1..0",
        "1.0 beta",
        "\u0661.\u0662",
    ],
)
def test_what_is_not_a_version_is_refused(text: str) -> None:
    with pytest.raises(VersionError):
        Version.parse(text)


@pytest.mark.parametrize(
    ("specifier", "version", "inside"),
    [
        ("<0.5.22", "0.5.9", True),
        ("<0.5.22", "0.5.22", False),
        ("<0.5.22", "0.5.22rc1", True),  # plain ordering, as OSV ranges: a candidate may lack the fix
        ("<0.5.22", "0.5.21.post1", True),
        (">=0.4.0,<0.9.0", "0.3.9", False),
        (">=0.4.0, <0.9.0", "0.8.5", True),
        ("==0.9", "0.9.0+cpu", True),
        ("!=0.9.0", "0.9", False),
        ("<=0.9.0,>0.8", "0.9.0", True),
    ],
)
def test_specifiers_hold_when_every_clause_does(specifier: str, version: str, inside: bool) -> None:
    assert Specifier.parse(specifier).contains(Version.parse(version)) is inside


@pytest.mark.parametrize(
    ("engine", "published", "why"),
    [
        ("sglang", None, "not published"),
        ("sglang", 0.511, "0.511 is not a string"),
        ("sglang", "  ", "'  ' is not a string"),
        ("sglang", "0.0.0.dev123+gabc", "is a source or CI build"),
        ("sglang", "0.0.0.dev1+g87549f8f0", "is a source or CI build"),
        ("llamacpp", "b1-0c1e570", "llama.cpp build number and commit"),
        ("llamacpp", "b6500", "llama.cpp build number"),
        ("reference", "0.1.0", "does not start with 'kvcanary-reference'"),
        ("openai", "gpt-4o-2024-08-06", "engine 'openai' has no version form"),
        ("vllm", "0.8.5 (cpu)", "is not a PEP 440 version"),
    ],
)
def test_a_node_version_that_names_no_release_says_why(engine: str, published: object, why: str) -> None:
    with pytest.raises(VersionError, match=re.escape(why)):
        node_version(engine, published)


def test_node_versions_that_name_a_release() -> None:
    assert node_version("sglang", " 0.5.12.post1 ") == Version.parse("0.5.12.post1")
    assert node_version("sglang", "0.5.0rc1") < Version.parse("0.5.0")
    assert node_version("vllm", "0.4.3.post1") > Version.parse("0.4.3")
    # Compared as 0.6.3, shown as published.
    assert node_version("vllm", "v0.6.3") == Version.parse("0.6.3")
    assert str(node_version("vllm", "v0.6.3")) == "v0.6.3"
    assert node_version("vllm", "0.32.0+cpu") == Version.parse("0.32.0")
    assert node_version("reference", "kvcanary-reference 0.1.0") == Version.parse("0.1.0")


# --- matching -------------------------------------------------------------------------------------


def test_a_pd_node_before_the_fix_matches_and_a_single_node_does_not() -> None:
    applies, unknown = matching("sglang", "0.5.11", {"disaggregation_mode": "decode"})
    assert ([d.id for d in applies], unknown) == ([PD_DEFECT], [])
    assert matching("sglang", "0.5.11", {"disaggregation_mode": "null"}) == ([], [])
    assert matching("sglang", "0.5.22", {"disaggregation_mode": "prefill"}) == ([], [])


def test_the_slot_advisory_applies_only_where_async_scheduling_meets_pipeline_parallelism() -> None:
    slot = "vllm-slot-stale-tokens-ghsa-v97p-wpxp-px84"
    both = {"async_scheduling": "True", "pipeline_parallel_size": "2"}
    assert slot in [d.id for d in matching("vllm", "0.20.0", both)[0]]
    for ruled_out in ({**both, "pipeline_parallel_size": "1"}, {**both, "async_scheduling": "False"}):
        applies, unknown = matching("vllm", "0.20.0", ruled_out)
        assert slot not in [d.id for d in applies] and not any(u.startswith(slot) for u in unknown)
    assert slot not in [d.id for d in matching("vllm", "0.21.0", both)[0]]
    assert slot not in [d.id for d in matching("vllm", "0.15.1", both)[0]]  # before async scheduling took PP


def test_the_2026_vllm_disclosures_are_in_the_shipped_file_with_their_fixed_releases() -> None:
    entries = {d.id: d for d in shipped().for_engine("vllm")}
    expected = {
        "vllm-slot-stale-tokens-ghsa-v97p-wpxp-px84": (">=0.16.0,<0.21.0", "0.21.0", "critical"),
        "vllm-thinking-end-forced-ghsa-fpch-3xrf-7q96": (">=0.21.0,<0.28.0", "0.28.0", "high"),
        "vllm-allowed-token-ids-logits-cve-2026-93840": ("<0.29.0", "0.29.0", "high"),
        "vllm-allowed-token-ids-condense-cve-2026-114049": ("<0.31.0", "0.31.0", "high"),
    }
    for id_, (affected, fixed, severity) in expected.items():
        entry = entries[id_]
        assert (entry.affected, entry.fixed_in, entry.severity) == (affected, fixed, severity)


def test_a_required_fact_the_node_does_not_publish_is_unknown_never_clean() -> None:
    expected = [f"{PD_DEFECT}: the node does not publish disaggregation_mode (needs prefill or decode)"]
    assert matching("sglang", "0.5.11", {}) == ([], expected)
    # Outside the range the fact does not matter: nothing to clear.
    assert matching("sglang", "0.5.22", {}) == ([], [])


@pytest.mark.parametrize(
    ("value", "applies"), [("True", True), ("TRUE", True), ("true", True), ("False", False)]
)
def test_boolean_facts_compare_case_insensitively(tmp_path: Path, value: str, applies: bool) -> None:
    found, unknown = matching("vllm", "0.8.5", {"enable_prefix_caching": value}, catalogue(tmp_path, ENTRY))
    assert ([d.id for d in found], unknown) == ((["vllm-example-1"] if applies else []), [])


def test_a_fact_vllm_renders_as_none_counts_as_unpublished(tmp_path: Path) -> None:
    _, unknown = matching("vllm", "0.8.5", {"enable_prefix_caching": "None"}, catalogue(tmp_path, ENTRY))
    assert unknown == ["vllm-example-1: the node does not publish enable_prefix_caching (needs True)"]


def test_one_published_fact_that_rules_a_defect_out_clears_it(tmp_path: Path) -> None:
    entry = {**ENTRY, "requires": {"enable_prefix_caching": [True], "kv_cache_dtype": ["fp8"]}}
    facts = {"enable_prefix_caching": "False"}
    assert matching("vllm", "0.8.5", facts, catalogue(tmp_path, entry)) == ([], [])


def test_an_unknown_version_is_unknown_for_an_engine_without_entries() -> None:
    assert matching("reference", "kvcanary-reference 0.1.0", {}) == ([], [])
    assert matching("reference", None, {}) == ([], ["version: not published"])


def test_matching_takes_a_parsed_version_too() -> None:
    applies, _ = matching("sglang", Version.parse("0.5.20"), {"disaggregation_mode": "prefill"})
    assert [d.id for d in applies] == [PD_DEFECT]


def test_entries_come_most_severe_first(tmp_path: Path) -> None:
    warning = {**ENTRY, "id": "vllm-example-2", "severity": "warning"}
    critical = {**ENTRY, "id": "vllm-example-3", "severity": "critical"}
    found = catalogue(tmp_path, warning, ENTRY, critical).for_engine("vllm")
    assert [d.severity for d in found] == ["critical", "high", "warning"]
