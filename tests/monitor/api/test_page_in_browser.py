"""The incident page as the person on call reads it: in headless Chromium, on a phone and a desktop.

The incident is the demo's, made by the monitor's own parts (``demo_incident.py``): the real
boundary probe's leak on a reference worker with the incident's defect, two hours of a gateway's
traffic posted as its tap posts it, the pages Alertmanager took, the quarantine put on and lifted,
the node fixed and the incident resolved. Chromium opens the link Alertmanager holds, served by
the service's own app under uvicorn, at a phone's width and a desktop's, and the test asks it what
a reader gets: nothing past the page's right edge (the document, every element, every line of
text, nothing scrolled or clipped sideways), the evidence told in words with the raw JSON folded
away, the chart's axes, one time format, a title cut on a word, and no script anywhere.

Chromium is Debian's (``chromium``, ``chromium-driver``), driven by Selenium; the test skips where
either is missing and fails instead under ``KVCANARY_REQUIRE_CHROMIUM=1`` (``scripts/test.sh``).
``KVCANARY_WRITE_SCREENSHOTS=DIR`` writes the page at each width to ``DIR`` (``docs/`` keeps them).
"""

from __future__ import annotations

import base64
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from tests.monitor.api.demo_incident import REPORTER, TARGET, DemoIncident, demo_incident
from tests.support.services import Alertmanager

pytestmark = [pytest.mark.external_service, pytest.mark.slow]  # Alertmanager, a worker, Chromium

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
#: Flags that keep Chromium headless and off the network: without the background-networking ones it
#: tries Google's hosts at every start, which this machine's closed network refuses.
FLAGS = (
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--hide-scrollbars",
)  # fmt: skip


@dataclass(frozen=True)
class View:
    name: str
    width: int
    height: int
    mobile: bool  # a phone honours the page's viewport meta, as Safari and Chrome on a phone do
    scale: int  # device pixels per CSS pixel: a phone's screen is dense


VIEWS = (View("phone", 390, 844, True, 2), View("desktop", 1280, 900, False, 1))
#: Every time on the page, in its one format.
WHEN = re.compile(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2} UTC")
#: A time as ISO text (what the blast radius's JSON carries): never shown to a reader.
ISO = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}")

#: What runs past the viewport's right edge: elements, lines of text, and boxes whose content is
#: cut or scrolled sideways (a reader on a phone never sees what is past their edge).
PAST_THE_EDGE = """
const width = document.documentElement.clientWidth, found = [];
const name = el => el.tagName.toLowerCase() + (el.id ? '#' + el.id : '');
const said = text => (text || '').replace(/\\s+/g, ' ').trim().slice(0, 80);
for (const el of document.body.querySelectorAll('*')) {
  const box = el.getBoundingClientRect();
  if (box.width === 0 && box.height === 0) continue;  // not rendered (a closed details' content)
  if (box.right > width + 0.5)
    found.push(`${name(el)} ends at ${box.right.toFixed(1)}: ${said(el.textContent)}`);
  const style = getComputedStyle(el);
  if (style.overflowX !== 'visible' && el.scrollWidth > el.clientWidth + 1)
    found.push(`${name(el)} cuts or scrolls its content sideways (${el.scrollWidth} > ${el.clientWidth})`);
}
const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
const range = document.createRange();
while (walker.nextNode()) {
  range.selectNodeContents(walker.currentNode);
  for (const line of range.getClientRects())
    if (line.right > width + 0.5)
      found.push(`text ends at ${line.right.toFixed(1)}: ${said(walker.currentNode.textContent)}`);
}
return {scrollWidth: document.documentElement.scrollWidth, innerWidth: window.innerWidth, width, found};
"""
#: Anything on the page that is, or would run, a script.
SCRIPTS = """
const found = [];
for (const el of document.querySelectorAll('*')) {
  if (['script', 'iframe', 'object', 'embed', 'noscript'].includes(el.tagName.toLowerCase()))
    found.push(el.tagName);
  for (const a of el.attributes) {
    if (a.name.toLowerCase().startsWith('on')) found.push(`${el.tagName} ${a.name}`);
    if (/^\\s*javascript:/i.test(a.value)) found.push(`${el.tagName} ${a.name}=${a.value}`);
  }
}
return found;
"""


def chromium(user_data: Path) -> Any:
    """Start headless Chromium under chromedriver; skip (or fail under KVCANARY_REQUIRE_CHROMIUM=1)
    where Debian's chromium, chromium-driver or Selenium is missing."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not shutil.which(p)]
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing.append("selenium (the dev extras)")
    if missing:
        why = f"headless Chromium needs {', '.join(missing)} (Debian: chromium, chromium-driver)"
        if os.environ.get("KVCANARY_REQUIRE_CHROMIUM") == "1":
            pytest.fail(f"{why}, and KVCANARY_REQUIRE_CHROMIUM=1 requires it", pytrace=False)
        pytest.skip(why)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--user-data-dir={user_data}"):
        options.add_argument(flag)
    # The drivers' paths given: Selenium Manager, which would look for them online, never runs.
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    driver = chromium(tmp_path / "chromium")
    try:
        yield driver
    finally:
        driver.quit()


def when(moment: str | datetime) -> str:
    """A time as the page writes it."""
    if isinstance(moment, str):
        moment = datetime.fromisoformat(moment)
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


# The page does not depend on the database: one backend is enough here (test_pages has both).
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_demo_incident_reads_whole_on_a_phone_and_a_desktop(
    browser: Any, session_factory: sessionmaker[Session], alertmanager: Alertmanager, tmp_path: Path
) -> None:
    with demo_incident(session_factory, alertmanager, tmp_path) as demo:
        facts = _Facts.of(demo)
        if folder := os.environ.get("KVCANARY_WRITE_SCREENSHOTS"):  # as a reader first sees it
            for view in VIEWS:
                _show(browser, view, demo.link)
                _screenshot(browser, view, Path(folder) / f"incident-page-{view.name}.png")
        for view in VIEWS:
            _show(browser, view, demo.link)
            assert browser.title.startswith(f"Incident {demo.incident_id}: "), browser.title
            _assert_within_width(browser, view, "as opened")
            _assert_reads(browser, facts)
            assert browser.execute_script(SCRIPTS) == [], "something on the page is or runs a script"
            _unfold_raw_evidence(browser, facts)
            _assert_within_width(browser, view, "with the raw evidence unfolded")


@dataclass(frozen=True)
class _Facts:
    """What the reader must find on the page, from what the test sent and the service answers."""

    title: str
    full_titles: list[str]  # what the title says uncut, of each failure that could have set it
    leak: dict[str, Any]  # the leak result, as the API answers it
    radius: dict[str, Any]
    callers: dict[str, int]  # the customers' over-pool 2xx responses in the window, from what was sent

    @classmethod
    def of(cls, demo: DemoIncident) -> _Facts:
        detail = demo.incident()
        leaks = [r for r in detail["results"] if r["verdict"] == "leak"]
        assert leaks, detail["results"]
        first = min(leaks, key=lambda r: r["started_at"])
        radius = demo.radius()
        window = radius["window"]
        start, end = (datetime.fromisoformat(window[k]).timestamp() for k in ("start", "end"))
        # The recorded traffic counts by the minute: the window's minutes, whole.
        callers = demo.affected_by_caller(start - start % 60, end - end % 60 + 60)
        full = [
            f"{r['verdict']} on {TARGET}/boundary: {' '.join(r['detail'].split())}"
            for r in detail["results"]
            if r["verdict"] in ("leak", "mismatch")  # the failure that opened or escalated it
        ]
        return cls(detail["title"], full, first, radius, callers)


def _show(browser: Any, view: View, link: str) -> None:
    """Open ``link`` in a viewport of ``view``'s size, as that device lays it out."""
    browser.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": view.width, "height": view.height, "deviceScaleFactor": view.scale, "mobile": view.mobile},
    )
    browser.get(link)


def _assert_within_width(browser: Any, view: View, how: str) -> None:
    measured = browser.execute_script(PAST_THE_EDGE)
    past = measured["found"]
    # A phone lays out a page wider than its screen by zooming out (innerWidth grows past the
    # device's width): every line then reads smaller, which is the failure, not a way out of it.
    fits = measured["scrollWidth"] <= measured["innerWidth"] == measured["width"] == view.width
    assert fits and not past, (
        f"{view.name} ({view.width} px), {how}: the page is {measured['scrollWidth']} px wide in a "
        f"viewport of {measured['innerWidth']}; " + "; ".join(past[:15])
    )


def _assert_reads(browser: Any, facts: _Facts) -> None:
    from selenium.webdriver.common.by import By

    seen = browser.find_element(By.TAG_NAME, "body").text  # rendered text only: what a reader sees
    # The title, cut on a word where it is cut at all.
    h1 = browser.find_element(By.TAG_NAME, "h1").text
    assert h1 == facts.title and h1.endswith("…"), (h1, facts.title)  # the demo's title is long
    kept = h1.removesuffix("…")
    full = next((t for t in facts.full_titles if t.startswith(kept)), None)
    assert full is not None, (kept, facts.full_titles)
    assert full[len(kept)] in " ,;:", f"the title is cut mid-word: {h1}"
    # One time format: every time a reader sees is WHEN; none is ISO text.
    assert not ISO.search(seen), ISO.findall(seen)
    assert len(WHEN.findall(seen)) >= 10
    # The blast radius: each customer's count and first and last answers, as the traffic says.
    rows = {}
    for row in browser.find_elements(By.XPATH, "//tr[th[.='Caller']]/following-sibling::tr"):
        caller, responses, first, last = (td.text for td in row.find_elements(By.TAG_NAME, "td"))
        rows[caller] = (int(responses), first, last)
    assert {c: n for c, (n, _, _) in rows.items()} == facts.callers and REPORTER not in rows
    for c in facts.radius["callers"]:
        assert rows[c["caller"]][1:] == (when(c["first"]), when(c["last"])), (c, rows[c["caller"]])
    affected = "//td[starts-with(., 'Responses affected')]/following-sibling::td"
    headline = browser.find_element(By.XPATH, affected)
    assert headline.text == str(sum(facts.callers.values())) and "listed by the operator" in seen
    _assert_chart(browser, facts.radius)
    # The leak's evidence told in words: whose marker came back to whom, the sizes, the pool.
    account = browser.find_element(By.CSS_SELECTOR, f"#result-{facts.leak['id']} ul.account").text
    evidence = facts.leak["evidence"]
    leak, capacity = evidence["leaks"][0], evidence["capacity"]
    for told in (
        f"marker {leak['marker_id']} of {leak['owner_tenant']} came back to {leak['reader_tenant']}",
        f"{facts.leak['prompt_tokens_sent']:,} tokens sent, {facts.leak['prompt_tokens_reported']} reported",
        *(f"{pool} {size:,}" for pool, size in capacity["pools"].items()),
        f"context window {capacity['context_window']:,}",
    ):
        assert told in account, (told, account)
    # The raw JSON is folded: its summary shows, the JSON does not.
    raw = browser.find_elements(By.CSS_SELECTOR, "details.raw")
    assert raw and all(not d.get_attribute("open") for d in raw)
    assert all(d.find_element(By.TAG_NAME, "summary").is_displayed() for d in raw)
    assert not any(d.find_element(By.TAG_NAME, "pre").is_displayed() for d in raw)
    assert '"probe_verdict"' not in seen


def _assert_chart(browser: Any, radius: dict[str, Any]) -> None:
    """The chart's axes: 0, half the peak and the peak up the left, five times along the bottom,
    each label shown whole inside the chart, large enough to read."""
    from selenium.webdriver.common.by import By

    series = radius["series"]
    peak = max(series["counts"])
    start = datetime.fromisoformat(series["start"])
    # Drawn over the window, which the last bucket passes.
    window = datetime.fromisoformat(radius["window"]["end"]) - start
    span = min(len(series["counts"]) * series["bucket_seconds"], int(window.total_seconds()))
    times = [(start + timedelta(seconds=span * k / 4)).strftime("%H:%M") for k in range(5)]
    chart = browser.find_element(By.CSS_SELECTOR, "figure.chart")
    labels = chart.find_elements(By.CSS_SELECTOR, ".count, .times span")
    assert [t.text for t in labels] == [*(str(n) for n in sorted({0, peak // 2, peak})), *times]
    box = chart.rect
    for label in labels:
        at = label.rect
        assert label.is_displayed() and at["height"] >= 10, (label.text, at)  # 10 CSS px or more
        inside = box["x"] <= at["x"] and at["x"] + at["width"] <= box["x"] + box["width"] + 0.5
        assert inside, (label.text, at, box)


def _unfold_raw_evidence(browser: Any, facts: _Facts) -> None:
    """Open the leak's raw evidence as a reader does (a tap on its summary): the JSON shows."""
    from selenium.webdriver.common.by import By

    folded = browser.find_element(By.CSS_SELECTOR, f"#result-{facts.leak['id']} details.raw")
    folded.find_element(By.TAG_NAME, "summary").click()
    pre = folded.find_element(By.TAG_NAME, "pre")
    assert pre.is_displayed() and facts.leak["evidence"]["leaks"][0]["marker_id"] in pre.text


def _screenshot(browser: Any, view: View, path: Path) -> None:
    """Write the whole page at ``view``'s width as a PNG, a pixel a CSS pixel (a phone's dense
    screen would make it four times the bytes for a picture in a document)."""
    height = browser.execute_script("return document.documentElement.scrollHeight")
    shot = browser.execute_cdp_cmd(
        "Page.captureScreenshot",
        {"format": "png", "captureBeyondViewport": True,
         "clip": {"x": 0, "y": 0, "width": view.width, "height": height, "scale": 1 / view.scale}},
    )  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(base64.b64decode(shot["data"]))
