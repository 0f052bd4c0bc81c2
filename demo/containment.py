"""The demo's containment: both halves, as an operator sets them up. The monitor signs the set with
the demo's key pair (``containment_signing.key_file``, made in the workdir as ``kvcanary containment
keygen`` makes it) and the gateway's tap holds the public key (``KVCANARY_TAP_QUARANTINE=1``,
``KVCANARY_TAP_QUARANTINE_PUBLIC_KEYS_FILE``). What the ``observe`` policy would have done, then
quarantine and the admission guard turned on for the defective target (its ``containment`` in the
demo's kvcanary.yml, reloaded as SIGHUP would) and the customers sent again through the gateway
(``gateway.py``): every later request to ``shop`` is the healthy worker's, and the blast
radius stops growing."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from kvcanary.demo.gateway import Gateway, blast_radii, clock_time, customers, wait_delivered
from kvcanary.monitor.containment.key_files import PRIVATE_NAME, PUBLIC_NAME, KeyPair, write_key_pair
from kvcanary.tap.containment.signed import parse_public_keys

if TYPE_CHECKING:
    from kvcanary.monitor.app import Monitor


def signing_keys(workdir: Path) -> KeyPair:
    """Return the demo's key pair for the quarantine set: made in ``workdir`` the first time, the
    one there after (a workdir used again: its gateway and monitor keep agreeing)."""
    private, public = workdir / PRIVATE_NAME, workdir / PUBLIC_NAME
    if private.exists() and public.exists():
        (key_id,) = parse_public_keys(public.read_text())
        return KeyPair(private, public, key_id)
    private.unlink(missing_ok=True)
    public.unlink(missing_ok=True)
    return write_key_pair(workdir)


def report_containment(monitor: Monitor, gateway: Gateway | None) -> None:
    """Print what containment (the ``observe`` policy in the demo) would have done, from the
    monitor's own quarantine rows, and what the gateway's tap said it would have kept off."""
    for entry in monitor.containment.rules.current():
        incident = f"incident #{entry.incident_id}" if entry.incident_id is not None else "by hand"
        mode = "quarantined" if entry.enforced else "would have quarantined (containment.mode: observe)"
        print(f"=== CONTAINMENT: {entry.target} {mode} since {clock_time(entry.since)}, {incident} ===")
        print(f"  reason    : {entry.reason}")
        if not entry.enforced:
            print(
                "  with containment.mode: quarantine, the gateways stop sending it customers within 2 s",
                flush=True,
            )
    said = _observed(gateway.log) if gateway is not None else []
    for line in said:
        print(f"  gateway   : {line}")
    if said:
        print(flush=True)


def _observed(log: Path) -> list[str]:
    """The tap's observe-mode lines in the gateway's log (each said once per target), shortened."""
    with contextlib.suppress(OSError):
        lines = log.read_text(errors="replace").splitlines()
        found = [
            line.removeprefix("kvcanary tap: ") for line in lines if "kvcanary tap: observe mode" in line
        ]
        return [line if len(line) <= 160 else line[:157] + "..." for line in found[:4]]
    return []


#: The policy the demo turns on for the defective target once its leak is shown (docs/operating.md).
CONTAINED = {"mode": "quarantine", "admission_guard": "enforce"}
SECOND_WAVE = 12


async def contain_and_send_again(monitor: Monitor, gateway: Gateway) -> None:
    """Turn quarantine and the admission guard on for the defective target (its ``containment`` in
    kvcanary.yml, reloaded as SIGHUP would), wait for the gateway to take it up, and send the
    customers again: every later request to ``shop`` is the healthy worker's, and the blast radius
    stops growing."""
    assert monitor.config_path is not None
    try:  # the first wave's tallies are read below: it must be over before the second begins
        await asyncio.wait_for(gateway.done.wait(), timeout=60)
    except TimeoutError:
        print("  (the customers' first requests are still going: containment not turned on)", flush=True)
        return
    config = yaml.safe_load(monitor.config_path.read_text())
    for target in config["targets"]:
        if target["name"] == "defective":
            target["containment"] = CONTAINED
    monitor.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    print("=== CONTAINMENT ON for 'defective': containment: {mode: quarantine, admission_guard: "
          "enforce} in kvcanary.yml, reloaded ===", flush=True)  # fmt: skip
    began = time.monotonic()
    if (refused := await monitor.reload("the demo turns containment on")) is not None:
        print(f"  (the reload was refused: {refused})", flush=True)
        return
    took = await _taken_up(gateway, began)
    for entry in monitor.containment.known:
        since = clock_time(entry.since)
        print(f"  quarantine: {entry.target} since {since} (incident #{entry.incident_id}), "
              f"{'enforced' if entry.enforced else 'observed'}: {entry.reason}")  # fmt: skip
    for guard in monitor.containment.guards.current():
        if guard.mode == "enforce":
            print(f"  guard     : prompts over {guard.kv_pool_tokens} tokens kept off {guard.target!r}")
    print(f"  gateway   : took it up {took:.1f}s after the reload" if took is not None
          else "  gateway   : did not say it took it up (see gateway.log)", flush=True)  # fmt: skip
    reads = sum(n for (_, via), n in monitor.containment.reads.counts().items() if via == "http")
    signer = monitor.containment.signer
    print(f"  signed    : with key {signer.key_id if signer else '(none)'} (containment_signing.key_file), "
          f"checked by the gateway's public key: {reads} reads so far "
          "(kvcanary_quarantine_set_reads_total)", flush=True)  # fmt: skip
    before = gateway.over_pool_answered.total()
    counted_before = await asyncio.to_thread(_affected, monitor)
    await customers(gateway, SECOND_WAVE, pace=0.2, seed=2027)
    tally = ", ".join(f"{n} {'answered by ' + w if w else f'status {s}'}"
                      for (s, w), n in sorted(gateway.shop_answers.items()))  # fmt: skip
    print(f"  customers : {SECOND_WAVE} more requests, those to model 'shop' (both workers): {tally}")
    late = gateway.over_pool_answered.total() - before
    print(f"  exposed   : {late} more over-pool answers from 'defective' after containment "
          f"({before} before it)", flush=True)  # fmt: skip
    await wait_delivered(monitor, gateway)
    counted = await asyncio.to_thread(_affected, monitor)
    for incident, affected in counted.items():
        print(f"  blast radius of incident #{incident}: {affected} response(s) now, "
              f"{counted_before.get(incident)} before containment")  # fmt: skip
    print(flush=True)


def _affected(monitor: Monitor) -> dict[int, int | None]:
    """The affected responses of each incident the demo reports a blast radius of, by id."""
    found = {}
    for radius, _ in blast_radii(monitor, monitor.settings, None):
        if radius is not None:
            data = radius.as_json()
            found[int(radius.incident["id"])] = data.get("affected_responses")
    return found


async def _taken_up(gateway: Gateway, began: float, timeout: float = 10.0) -> float | None:
    """Seconds until the gateway's log says it quarantined the defective deployment, or None."""
    while time.monotonic() - began < timeout:
        with contextlib.suppress(OSError):
            if "quarantined by kvcanary: target 'defective'" in gateway.log.read_text(errors="replace"):
                return time.monotonic() - began
        await asyncio.sleep(0.1)
    return None
