"""The demo's gateway: a LiteLLM proxy with the kvcanary tap in front of the demo's workers, and
three simulated customers sending traffic through it while the leak is reproduced.

Started when a LiteLLM venv is found (``$KVCANARY_LITELLM_VENV``, else the one
``scripts/setup-litellm.sh`` caches in ``~/.cache/kvcanary``); without one the demo runs on and
says what it skipped. The proxy runs as the tests run it: no database (callers are static keys
through ``custom_auth``), no retries, bound to 127.0.0.1, the tap imported from this installation.
The customers count what they sent themselves, so the demo can print the blast radius beside the
truth.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import secrets
import subprocess
import textwrap
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import yaml
from sqlalchemy import func, select

import kvcanary.tap
from kvcanary.monitor.api.blast import sources_of
from kvcanary.monitor.blast.compute import blast_radius
from kvcanary.monitor.blast.report import BlastRadius
from kvcanary.monitor.config.settings import Settings
from kvcanary.monitor.paging.links import incident_url
from kvcanary.monitor.storage.models import Incident, Target, TrafficMinute
from kvcanary.processes import free_port, stop_process, wait_http
from kvcanary.wire import api_base_key

if TYPE_CHECKING:
    from kvcanary.monitor.app import Monitor

#: Customer keys → team. The keys stay in the gateway; the monitor sees the teams.
CUSTOMERS = {"sk-demo-acme-0001": "acme", "sk-demo-globex-0002": "globex", "sk-demo-initech-0003": "initech"}
#: Prompt sizes (one byte, one token on the reference worker): two under the defective node's
#: 2,048-token prefill pool, two over it and inside its 8,192-token window.
SIZES = (500, 1200, 3000, 4500)
REQUESTS = 30
WORDS = ("invoice", "shipment", "warranty", "battery", "charger", "router", "firmware", "refund", "parcel")

#: The environment the proxy gets from the demo's own, besides its settings and the tap's.
_PASSED_ON = {"PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "XDG_CACHE_HOME", "SSL_CERT_FILE", "SSL_CERT_DIR"}

_AUTH = """
from fastapi import HTTPException
from litellm.proxy._types import UserAPIKeyAuth

TEAMS = {teams!r}


async def user_api_key_auth(request, api_key):
    key = api_key.removeprefix("Bearer ").strip()
    if key not in TEAMS:
        raise HTTPException(status_code=401, detail="unknown key")
    return UserAPIKeyAuth(api_key=key, team_id=TEAMS[key], key_alias=TEAMS[key] + "-key")
"""


def litellm_venv() -> Path | None:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvcanary" / "venv-litellm"
    venv = Path(os.environ.get("KVCANARY_LITELLM_VENV") or cache)
    return venv if (venv / "bin" / "litellm").exists() and (venv / ".kvcanary-setup").exists() else None


@dataclass
class Gateway:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    #: The deployments by the key of their api_base (``kvcanary.wire.api_base_key``): worker names.
    deployments: dict[str, str] = field(default_factory=dict)
    #: Over-pool prompts answered 200 by the defective node, by customer: the truth to compare with.
    over_pool_answered: Counter[str] = field(default_factory=Counter)
    #: Requests to ``shop`` by (status, the worker that answered: "" for none), the latest wave's.
    shop_answers: Counter[tuple[int, str]] = field(default_factory=Counter)
    sent: int = 0
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def stop(self) -> None:
        stop_process(self.proc)


def start_gateway(
    workdir: Path,
    urls: dict[str, str],
    worker_key: str,
    monitor_url: str,
    ingest_token: str,
    public_keys: Path,
) -> Gateway:
    """Start the proxy: model ``shop`` on both workers (LiteLLM picks one a request), ``shop-eu``
    on the healthy one alone; its tap takes only a quarantine set signed by ``public_keys``' key."""
    venv = litellm_venv()
    assert venv is not None
    folder = workdir / "gateway"
    folder.mkdir(exist_ok=True)
    (folder / "custom_auth.py").write_text(textwrap.dedent(_AUTH.format(teams=CUSTOMERS)))
    deployments = [
        {"model_name": name, "litellm_params": {"model": "openai/kvcanary-reference", "api_base": f"{url}/v1",
                                                "api_key": worker_key}}
        for name, url in [("shop", urls["defective"]), ("shop", urls["healthy"]),
                          ("shop-eu", urls["healthy"])]
    ]  # fmt: skip
    config = {
        "model_list": deployments,
        "litellm_settings": {
            "telemetry": False, "num_retries": 0, "request_timeout": 60,
            "callbacks": "kvcanary.tap.litellm.tap",
        },
        "general_settings": {
            "custom_auth": "custom_auth.user_api_key_auth", "master_key": "sk-" + secrets.token_hex(16),
        },
    }  # fmt: skip
    config_path = folder / "config.yaml"  # it holds the worker's key and the master key
    config_path.touch(mode=0o600)
    config_path.chmod(0o600)
    config_path.write_text(yaml.safe_dump(config))
    # The tap, importable in the proxy's venv without the rest of this installation: a folder
    # holding only a link to the `kvcanary` package (whose tap uses the standard library alone).
    path = folder / "pythonpath"
    path.mkdir(exist_ok=True)
    link = path / "kvcanary"
    if link.is_symlink() or link.exists():  # a workdir used again: point it at this installation
        link.unlink()
    link.symlink_to(Path(kvcanary.tap.__file__).resolve().parent.parent, target_is_directory=True)
    port = free_port()
    # Only what the proxy needs: a DATABASE_URL would put LiteLLM in database mode on that
    # database, and provider keys are none of its business here.
    env = {
        **{k: v for k, v in os.environ.items() if k in _PASSED_ON},
        "LITELLM_OFFLINE_MODE": "true", "LITELLM_LOG": "ERROR", "PYTHONPATH": str(path),
        "KVCANARY_TAP_URL": monitor_url, "KVCANARY_TAP_TOKEN": ingest_token,
        "KVCANARY_TAP_KEY": secrets.token_urlsafe(24), "KVCANARY_TAP_GATEWAY": "demo-litellm",
        # The gateway's half of containment: the quarantine set and the admission guard's facts, read
        # from the monitor (observe: routes as before and logs once what it would have kept off),
        # taken only when the monitor's key signed them.
        "KVCANARY_TAP_QUARANTINE": "1", "KVCANARY_TAP_QUARANTINE_PUBLIC_KEYS_FILE": str(public_keys),
    }  # fmt: skip
    log_path = workdir / "gateway.log"
    log = log_path.open("wb")
    argv = [str(venv / "bin" / "litellm"), "--config", str(folder / "config.yaml"), "--host", "127.0.0.1",
            "--port", str(port)]  # fmt: skip
    proc = subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, cwd=folder, env=env, start_new_session=True
    )
    names = {api_base_key(f"{url}/v1"): name for name, url in urls.items()}
    return Gateway(f"http://127.0.0.1:{port}", proc, log_path, names)


async def wait_ready(gateway: Gateway, timeout: float = 120.0) -> bool:
    """Return whether the gateway answered its liveness page within ``timeout`` seconds."""
    url = f"{gateway.url}/health/liveliness"
    try:
        await asyncio.to_thread(wait_http, url, timeout, gateway.proc, every=0.5)
    except (RuntimeError, TimeoutError):
        return False
    return True


async def customers(gateway: Gateway, requests: int = REQUESTS, pace: float = 0.5, seed: int = 2026) -> None:
    """Send ``requests`` chat completions, the customers in turn, and count the truth: which worker
    answered each (LiteLLM's ``x-litellm-model-api-base``)."""
    rng = random.Random(seed)
    keys = list(CUSTOMERS)
    gateway.shop_answers.clear()
    gateway.done.clear()
    async with httpx.AsyncClient(timeout=60) as client:
        for i in range(requests):
            key, chars = keys[i % len(keys)], rng.choice(SIZES)
            model = "shop" if i % 4 else "shop-eu"
            text = (f"{CUSTOMERS[key]} asks: " + " ".join(rng.choice(WORDS) for _ in range(chars // 5)))[
                :chars
            ]
            body: dict[str, Any] = {"model": model, "max_tokens": 16, "temperature": 0,
                                    "messages": [{"role": "user", "content": text}]}  # fmt: skip
            try:
                answer = await client.post(f"{gateway.url}/v1/chat/completions", json=body,
                                           headers={"Authorization": f"Bearer {key}"})  # fmt: skip
                status, base = answer.status_code, answer.headers.get("x-litellm-model-api-base", "")
            except httpx.HTTPError:
                status, base = 0, ""
            gateway.sent += 1
            worker = gateway.deployments.get(api_base_key(base), "") if status == 200 else ""
            if model == "shop":
                gateway.shop_answers[status, worker] += 1
            if worker == "defective" and chars > 2048:
                gateway.over_pool_answered[CUSTOMERS[key]] += 1
            await asyncio.sleep(pace)
    gateway.done.set()


def maybe_start_gateway(
    workdir: Path, urls: dict[str, str], key: str, port: int, ingest_token: str, public_keys: Path
) -> Gateway | None:
    """Start the LiteLLM gateway with the tap when a LiteLLM venv is set up; otherwise say so."""
    if litellm_venv() is None:
        print("  (skipped the gateway: no LiteLLM venv — no customer traffic, no blast radius; "
              "scripts/demo.sh sets one up with scripts/setup-litellm.sh)", flush=True)  # fmt: skip
        return None
    gateway = start_gateway(workdir, urls, key, f"http://127.0.0.1:{port}", ingest_token, public_keys)
    print(f"  gateway   {gateway.url}  LiteLLM with the kvcanary tap (starting), KVCANARY_TAP_QUARANTINE=1 "
          f"with the monitor's public key {public_keys.name}", flush=True)  # fmt: skip
    return gateway


async def run_traffic(gateway: Gateway) -> None:
    """Once the proxy answers, the customers send their traffic (``done`` is set either way)."""
    if await wait_ready(gateway):
        print(f"  gateway   {gateway.url} ready: 3 customers send traffic through it\n", flush=True)
        await customers(gateway)
    else:
        print("  (the gateway did not start: see gateway.log in the workdir)", flush=True)
        gateway.done.set()


async def report_blast_radius(
    monitor: Monitor, settings: Settings, paged: int | None, gateway: Gateway
) -> None:
    """Once the customers are done and the tap has delivered, print the paged incident's blast
    radius and, where it is another, the boundary incident's (the over-pool answers)."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(gateway.done.wait(), timeout=90)
    await wait_delivered(monitor, gateway)
    for radius, page in await asyncio.to_thread(blast_radii, monitor, settings, paged):
        print_blast_radius(radius, gateway, page)


async def wait_delivered(monitor: Monitor, gateway: Gateway, timeout: float = 20.0) -> None:
    """Wait until the monitor has stored a record of every request the customers sent, or its count
    has stood still for 2 s (the tap posts within a second; a loaded machine's monitor may lag)."""
    deadline, last, still = time.monotonic() + timeout, -1, 0
    while time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        stored = await asyncio.to_thread(_stored_records, monitor)
        still = still + 1 if stored == last else 0
        if stored >= gateway.sent or still >= 4:
            return
        last = stored


def _stored_records(monitor: Monitor) -> int:
    """Records the monitor has judged (the per-minute counts hold every one, flagged or not)."""
    with monitor.read_session_factory() as session:
        return int(session.scalar(select(func.coalesce(func.sum(TrafficMinute.records), 0))) or 0)


def blast_radii(
    monitor: Monitor, settings: Settings, paged: int | None
) -> list[tuple[BlastRadius | None, str]]:
    """The blast radii to print, with their pages' links (database work: off the event loop)."""
    ids = [paged] if paged else []
    out = []
    with monitor.read_session_factory() as session:
        boundary = session.execute(
            select(Incident.id)
            .join(Target)
            .where(Target.name == "defective", Incident.probe == "boundary", Incident.state == "open")
        ).scalar_one_or_none()
        ids += [boundary] if boundary is not None and boundary not in ids else []
        sources = sources_of(settings, monitor.traffic.judge)
        for incident_id in ids:
            radius = blast_radius(session, incident_id, settings, sources)
            opened = radius.incident["opened_at"] if radius else None
            page = incident_url(settings.api.base_url, incident_id, opened, monitor.token) if opened else ""
            out.append((radius, page))
    return out


def print_blast_radius(radius: BlastRadius | None, gateway: Gateway, page_url: str) -> None:
    """Print an incident's blast radius beside what the customers counted themselves."""
    if radius is None:
        return
    data = radius.as_json()
    c = radius.criterion
    count = data["affected_responses"] if c.kind != "at_risk" else data["at_risk_responses"]
    print(f"=== BLAST RADIUS of incident #{radius.incident['id']} ({radius.incident['probe']}) ===")
    print(f"  window    : {clock_time(radius.window.start.at)} to {clock_time(radius.window.end.at)}")
    print(f"              from {radius.window.start.how}")
    print(f"  rule      : {c.text}")
    print(f"  {c.label:<9} : {count if count is not None else 'unknown'} response(s)"
          + (f" from {radius.primary.name}" if radius.primary else ""))  # fmt: skip
    for item in data["callers"]:
        print(f"  {item['caller']:<10}: {item['responses']} (first {item['first']}, last {item['last']})")
    if gateway.sent < REQUESTS:
        print(
            f"  (the gateway carried {gateway.sent} of the customers' {REQUESTS} requests: see gateway.log)"
        )
    truth = ", ".join(f"{k} {v}" for k, v in sorted(gateway.over_pool_answered.items())) or "none"
    print(f"  the customers' own count of over-pool prompts answered 200: {truth} ({gateway.sent} sent)")
    print(f"  page      : {page_url}\n", flush=True)


def clock_time(moment: datetime) -> str:
    return moment.strftime("%H:%M:%S UTC")
