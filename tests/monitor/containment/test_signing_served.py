"""The quarantine set's signing key as ``kvcanary serve`` takes it (``monitor/containment/signing.py``):

- a key a policy needs and cannot be read stops the start with exit 2 naming the setting (never the
  key), and a reload that would need one is refused; the ``observe`` default needs none, and then
  serves no set;
- each gateway's reads are counted by the name it sends, and ``KVCanaryContainmentUnapplied``'s
  expression, in a real Prometheus scraping the monitor, names a target in quarantine mode until a
  gateway reads the set;
- a key rotation walked end to end as ``docs/operating.md`` has it, over the JetStream bucket and
  HTTP, with SIGHUP reloads: the gateways get the new public key first, then the monitor its new
  private key; a tap holding the old key alone is left behind (it refuses the new key's sets and
  keeps its last), one holding both follows, and once the old key is gone the new one alone does.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from kvcanary.tap.containment.bucket import BucketWatch
from kvcanary.tap.containment.signed import parse_public_keys
from kvcanary.tap.containment.watch import QuarantineWatch
from kvcanary.wire import GATEWAY_HEADER, QUARANTINE_HELD_HEADER, api_base_key
from tests.monitor.served import Served, reference_target
from tests.support.jetstream import NATS_URL, StreamNames
from tests.support.services import start_prometheus
from tests.support.signing import SigningKeys, make_keys, served_set

INGEST = "signing-test-ingest-token-0123456789"
RULES = Path(__file__).resolve().parents[3] / "alerts" / "kvcanary.rules.yml"
#: A target nobody serves: these tests are about the set, not about probing.
NOWHERE = "http://127.0.0.1:9"


def config(**more: Any) -> dict[str, Any]:
    return {
        "targets": [reference_target("glm", NOWHERE, probes=["canary"], probe_intervals={"canary": 3600})],
        "containment": {"mode": "quarantine"},
        "traffic": {"ingest_token_env": "KVC_TEST_INGEST"},
        **more,
    }


def serve_briefly(monitor: Served) -> tuple[int, str]:
    """Run ``kvcanary serve`` expecting it to stop at once; return its exit code and output."""
    monitor.migrate()
    done = monitor.kvcanary("serve", "--config", str(monitor.config_path), timeout=90)
    return done.returncode, done.stdout + done.stderr


def test_serve_exits_2_naming_the_key_a_quarantine_needs_and_never_shows_it(
    served: Callable[..., Served], tmp_path: Path
) -> None:
    monitor = served(config())
    monitor.env.pop("KVCANARY_QUARANTINE_SIGNING_KEY", None)
    code, said = serve_briefly(monitor)
    assert code == 2 and "containment_signing.key_env" in said, said
    assert "KVCANARY_QUARANTINE_SIGNING_KEY" in said and "glm's containment mode is quarantine" in said
    assert "Traceback" not in said
    garbage = tmp_path / "not-a-key"
    garbage.write_text("c2VjcmV0LWJ1dC1ub3QtYS1rZXk=\n")  # base64, 23 bytes: not a seed
    monitor.config["containment_signing"] = {"key_file": str(garbage)}
    code, said = serve_briefly(monitor)
    assert code == 2 and "containment_signing.key_file: not an Ed25519 private key" in said, said
    assert "c2VjcmV0" not in said  # the key file's text is never repeated


def test_observe_without_a_key_starts_and_serves_no_set(served: Callable[..., Served]) -> None:
    monitor = served(config(containment={"mode": "observe"}))
    monitor.env["KVC_TEST_INGEST"] = INGEST
    monitor.start()
    answer = httpx.get(monitor.url + "/api/v1/quarantine", headers={"Authorization": f"Bearer {INGEST}"})
    assert answer.status_code == 503 and "containment_signing" in answer.text
    assert monitor.samples("kvcanary_quarantine_signing_key_info") == []
    assert monitor.value("kvcanary_target_containment_mode", target="glm", mode="observe") == 1


def test_reads_are_counted_per_gateway_and_unapplied_fires_until_a_gateway_reads(
    served: Callable[..., Served], tmp_path: Path
) -> None:
    keys = make_keys(tmp_path / "keys")
    monitor = served(config(containment_signing=keys.monitor_config()))
    monitor.env["KVC_TEST_INGEST"] = INGEST
    monitor.start()
    rule = next(r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]
                if r.get("alert") == "KVCanaryContainmentUnapplied")  # fmt: skip
    scraped = {"kvcanary": [monitor.url.removeprefix("http://")]}
    prometheus = start_prometheus(tmp_path / "prometheus", scraped)
    watch = None
    try:
        unapplied = lambda: {s["metric"]["target"] for s in prometheus.query(rule["expr"])}  # noqa: E731
        assert monitor.wait_for("the rule to name glm, which no gateway reads for", unapplied, 30) == {"glm"}
        watch = QuarantineWatch(
            monitor.url, INGEST, keys=keys.public_keys, gateway="gw-east", poll_seconds=0.2
        )
        monitor.wait_for("the rule to go quiet once a gateway reads", lambda: not unapplied(), 30)
        served_set(monitor.url, INGEST, keys, gateway="gw-west")
        reads = {
            (labels["gateway"], labels["via"]): v
            for labels, v in monitor.samples("kvcanary_quarantine_set_reads_total")
        }
        assert reads[("gw-east", "http")] >= 2 and reads[("gw-west", "http")] == 1, reads
        last = monitor.value(
            "kvcanary_quarantine_set_last_read_timestamp_seconds", gateway="gw-east", key_id=keys.key_id
        )
        assert last is not None and time.time() - last < 10
        assert watch.current.key_id == keys.key_id and not watch.failing
        for held in ("7 0123456789abcdef", "8 fedcba9876543210"):  # key ids no monitor holds: one series
            forged = {
                "Authorization": f"Bearer {INGEST}",
                GATEWAY_HEADER: "gw-forged",
                QUARANTINE_HELD_HEADER: held,
            }
            assert httpx.get(monitor.url + "/api/v1/quarantine", headers=forged).status_code == 200
        forged_keys = {
            labels["key_id"]
            for labels, _ in monitor.samples("kvcanary_quarantine_set_last_read_timestamp_seconds")
            if labels["gateway"] == "gw-forged"
        }
        assert forged_keys == {"(unknown)"}
    finally:
        if watch is not None:
            watch.close()
        prometheus.stop()


def test_a_key_rotation_walked_end_to_end(
    served: Callable[..., Served], stream_names: StreamNames, tmp_path: Path
) -> None:
    old, new = make_keys(tmp_path / "old"), make_keys(tmp_path / "new")
    signing = {"key_file": str(old.private), "renew_seconds": 1, "expires_seconds": 30}
    traffic = {
        "source": "jetstream",
        "ingest_token_env": "KVC_TEST_INGEST",
        "jetstream": stream_names.config(),
    }
    monitor = served(config(containment_signing=signing, traffic=traffic))
    monitor.env["KVC_TEST_INGEST"] = INGEST
    monitor.start()
    auth = {"Authorization": f"Bearer {monitor.token}"}
    bucket = stream_names.quarantine_bucket
    both = tmp_path / "old-and-new.pub"  # the gateways' and the monitors' public keys while rotating
    both.write_text(old.public.read_text() + new.public.read_text())

    def tap(gateway: str, *holding: Path, http: bool = False) -> QuarantineWatch:
        """A gateway's tap holding the public keys of ``holding``: watching the bucket, or polling."""
        keys = parse_public_keys("".join(path.read_text() for path in holding))
        if http:
            return QuarantineWatch(monitor.url, INGEST, keys=keys, gateway=gateway, poll_seconds=0.2)
        return BucketWatch(NATS_URL, bucket=bucket, keys=keys, gateway=gateway, poll_seconds=0.2)

    def applies(gateway: str, key: SigningKeys) -> float | None:
        """When the monitor last heard ``gateway`` read the set holding one ``key`` signed."""
        return monitor.value("kvcanary_quarantine_set_last_read_timestamp_seconds", gateway=gateway,
                             key_id=key.key_id)  # fmt: skip

    def reload(**change: Any) -> float:
        """Change the monitor's containment_signing and SIGHUP it; return the reload clock before."""
        before = monitor.value("kvcanary_config_last_reload_success_timestamp_seconds") or 0.0
        signing = {**monitor.config["containment_signing"], **change}
        monitor.config["containment_signing"] = {k: v for k, v in signing.items() if v is not None}
        monitor.write_config()
        monitor.signal(signal.SIGHUP)
        return before

    def reloaded(before: float) -> bool:
        return (monitor.value("kvcanary_config_last_reload_success_timestamp_seconds") or 0.0) > before

    glm = api_base_key(NOWHERE)
    watches = [tap("gw-old", old.public), tap("gw-http-old", old.public, http=True)]
    try:
        put = httpx.post(
            f"{monitor.url}/api/v1/targets/glm/quarantine", json={"reason": "drain"}, headers=auth
        )
        assert put.status_code == 201, put.text
        monitor.wait_for(
            "the old key's tap to take the quarantine", lambda: watches[0].current.enforced.get(glm)
        )
        # 1. Every gateway gets the new public key beside the old one (a restart of each).
        watches += [tap("gw-both", both), tap("gw-http-both", both, http=True)]
        rotating = watches[2:]
        taken = lambda: all(w.current.enforced.get(glm) for w in rotating)  # noqa: E731
        monitor.wait_for("the rotating taps to take the set", taken)
        # 2. The monitors: the new private key, the old public key still theirs; reloaded.
        before = reload(key_file=str(new.private), public_keys_file=str(old.public))
        monitor.wait_for("the reload taken", lambda: reloaded(before))
        in_force = lambda: monitor.value("kvcanary_quarantine_signing_key_info", key_id=new.key_id)  # noqa: E731
        monitor.wait_for("the new key in force", in_force)
        assert served_set(monitor.url, INGEST, new)["deployments"]  # HTTP: signed with the new key at once
        # The bucket's set is signed anew within renew_seconds: the rotating taps follow, and the
        # monitor sees that they do, by the key of the set each says it applies.
        followed = lambda: all(w.current.key_id == new.key_id for w in rotating)  # noqa: E731
        monitor.wait_for("the new key's set taken", followed, 15)
        monitor.wait_for("the rotating gateways seen applying it",
                         lambda: applies("gw-both", new) and applies("gw-http-both", new), 15)  # fmt: skip
        lifted = httpx.delete(f"{monitor.url}/api/v1/targets/glm/quarantine", headers=auth)
        assert lifted.status_code == 200, lifted.text
        monitor.wait_for(
            "the lift at the rotating taps", lambda: not any(w.current.enforced for w in rotating)
        )
        # A gateway left with the old key alone refuses the new key's sets and keeps its last (the
        # reason the gateways get the new key first), and the monitor sees it still on the old key.
        for watch in watches[:2]:
            assert watch.current.enforced.get(glm) and watch.refused["unknown_key"] >= 1
        assert applies("gw-old", old) and applies("gw-http-old", old)
        assert applies("gw-old", new) is None and applies("gw-http-old", new) is None
        # 3. The old key leaves: the gateways hold the new one alone, the monitors trust only theirs.
        watches.append(tap("gw-new", new.public))
        monitor.wait_for(
            "the new key's tap to take the set", lambda: watches[-1].current.key_id == new.key_id
        )
        assert not watches[-1].current.enforced
        before = reload(public_keys_file=None)
        monitor.wait_for("the reload taken", lambda: reloaded(before))
        assert monitor.value("kvcanary_config_last_reload_successful") == 1
        # Nothing of the rotation looked like a forgery to the monitor.
        assert sum(v for _, v in monitor.samples("kvcanary_quarantine_bucket_foreign_total")) == 0
        # A reload whose key cannot be read is refused, and the key in force stays.
        reload(key_file=str(tmp_path / "gone.key"))
        monitor.wait_for(
            "the reload refused", lambda: monitor.value("kvcanary_config_last_reload_successful") == 0
        )
        assert "containment_signing.key_file: cannot read" in monitor.log()
        assert monitor.value("kvcanary_quarantine_signing_key_info", key_id=new.key_id) == 1
    finally:
        for watch in watches:
            watch.close()
