"""Where a target's credentials may go: the one rule every request of the target's client asks.

The monitor holds every tenant's API key, and reads addresses from places the operator did not
write: an SGLang gateway lists its workers (``GET /workers``), and a compromised gateway, or one
mistyped registration, lists whatever it likes. What a gateway lists is input, not configuration
(as with Prometheus's service discovery, filtered before any scrape): a node it lists is sent no
credential unless the operator's own words cover it.

A target's :class:`CredentialScope` is

- the origin of its ``base_url`` (scheme, host, port: the rule HTTP clients apply to
  ``Authorization`` on a redirect);
- the origins of the URLs the file writes for its nodes (``info_url``, ``metrics_url``,
  ``log_metrics_url``): a node the gateway lists is never among them, whatever its name;
- its ``credential_hosts``, each entry one of :func:`parse_host_rule`'s forms: ``host`` (any port),
  ``host:port``, ``[v6]`` or ``[v6]:port``, a CIDR (``10.0.0.0/8``, ``fd00::/8``: IP addresses
  written in a URL) or a DNS suffix (``.svc.cluster.local``: the names under it, not itself).

A URL is matched as the HTTP client will connect to it (yarl, aiohttp's own parser; never a
string match): its host as sent (IDNA-encoded), lower-cased, one trailing dot dropped, and the
scheme's default port filled in. A URL carrying userinfo is in no scope. Nothing is resolved (a
name's address is DNS's word and may change between a check and a connection), so a CIDR covers
addresses written as addresses only, and a host that merely resolves like one (``127.1``,
``2130706433``, ``0x7f.0.0.1``) is a name that no address entry covers. An IPv4-mapped IPv6
address (``::ffff:10.0.0.5``) is the IPv4 address it reaches.

:class:`Credentials` decides each request's ``Authorization`` from the scope: the tenant's key at
the base URL's origin; the target's worker credential where it states one, else the tenant's key,
at the other origins in scope; nothing anywhere else.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from yarl import URL

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
#: (scheme, host as matched, port): what a credential is scoped to.
Origin = tuple[str, str, int]
#: Where a URL is, for the credentials it may carry: the base URL's origin, another origin in
#: scope, or outside the scope (None).
Place = Literal["base", "scope"] | None

_LABEL = re.compile(r"^(?!-)[a-z0-9_-]{1,63}(?<!-)$")
_DEFAULT_PORTS = {"http": 80, "https": 443}
#: Origins remembered per client, so the hot path of a probe asks a dict, not a parser.
_MEMO_SIZE = 4096


@dataclass(frozen=True)
class HostRule:
    """One ``credential_hosts`` entry: a host (an address or a name) on any port or one port, a
    network of addresses, or the names under a DNS suffix."""

    host: str | None = None
    address: IPAddress | None = None
    port: int | None = None
    network: IPNetwork | None = None
    suffix: str | None = None

    def covers(self, host: str, address: IPAddress | None, port: int) -> bool:
        """Return whether a URL at ``host`` (``address`` where the host is one) and ``port`` is covered."""
        if self.network is not None:
            return address is not None and address.version == self.network.version and address in self.network
        if self.suffix is not None:
            return address is None and host.endswith(self.suffix)
        if self.port is not None and port != self.port:
            return False
        if self.address is not None:
            return address == self.address
        return address is None and host == self.host


def parse_host_rule(entry: str) -> HostRule:
    """Return the rule ``entry`` states; raise ValueError saying what is wrong with it.

    Forms: ``gpu-7.internal`` or ``10.0.0.7`` (that host, any port), ``gpu-7.internal:30000``,
    ``[fd00::7]`` or ``[fd00::7]:30000`` (a bare ``fd00::7`` too), ``10.0.0.0/8`` or ``fd00::/8``
    (a CIDR, host bits clear, not the whole address space), ``.svc.cluster.local`` (names under the
    suffix). Names are ASCII (IDNA names in their ``xn--`` form), case and one trailing dot ignored.
    """
    text = entry.strip()
    if not text:
        raise ValueError("an entry is empty")
    if not text.isascii():
        raise ValueError(f"{text!r}: write a name in its ASCII (xn--) form")
    if "://" in text or "@" in text or "?" in text or "#" in text:
        raise ValueError(f"{text!r}: write a host, host:port, CIDR or .suffix, not a URL")
    if "/" in text:
        return HostRule(network=_network(text))
    if text.startswith("*."):
        raise ValueError(f"{text!r}: write a DNS suffix as {text[1:]!r}")
    if text.startswith("."):
        return HostRule(suffix="." + _name(text[1:], text))
    if text.startswith("["):
        inside, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise ValueError(f"{text!r}: expected [address] or [address]:port")
        port = _port(rest[1:], text) if rest else None
        return HostRule(address=_address(inside, text, version=6), port=port)
    if text.count(":") > 1:
        return HostRule(address=_address(text, text, version=6))
    host, colon, port_text = text.partition(":")
    port = _port(port_text, text) if colon else None
    try:
        return HostRule(address=_mapped(ipaddress.IPv4Address(host)), port=port)
    except ValueError:
        return HostRule(host=_name(host, text), port=port)


def _network(text: str) -> IPNetwork:
    try:
        network = ipaddress.ip_network(text, strict=True)
    except ValueError as exc:
        raise ValueError(f"{text!r}: not a CIDR ({exc})") from None
    if network.prefixlen == 0:
        raise ValueError(f"{text!r} covers every address: name the networks the workers are in")
    return network


def _address(text: str, entry: str, *, version: int) -> IPAddress:
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        raise ValueError(f"{entry!r}: not an IPv{version} address") from None
    return _mapped(address)


def _port(text: str, entry: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"{entry!r}: the port must be a number from 1 to 65535")
    return int(text)


def _name(text: str, entry: str) -> str:
    """Return a DNS name lower-cased without its trailing dot; raise ValueError for one that is not."""
    name = text.lower().removesuffix(".")
    labels = name.split(".")
    if not name or len(name) > 253 or not all(_LABEL.match(label) for label in labels):
        raise ValueError(f"{entry!r}: not a host name (letters, digits, '-' and '_' in dot-separated labels)")
    if labels[-1].isdigit():  # 127.1 or 2130706433: an address to a resolver, a name to this rule
        raise ValueError(f"{entry!r}: write an IPv4 address as four decimal numbers")
    return name


def _mapped(address: IPAddress) -> IPAddress:
    """Return the IPv4 address an IPv4-mapped IPv6 address reaches, else ``address``."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def origin_of(url: URL) -> tuple[Origin, IPAddress | None] | None:
    """Return ``url``'s origin as credentials are scoped (module docstring) and its host's address
    where the host is one; None for a URL no credential may go to (userinfo, no host, not HTTP)."""
    port = url.port or _DEFAULT_PORTS.get(url.scheme)
    host = url.raw_host
    if url.scheme not in _DEFAULT_PORTS or not host or port is None or url.raw_user or url.raw_password:
        return None
    host = host.lower().removesuffix(".")
    try:
        address: IPAddress | None = _mapped(ipaddress.ip_address(host))
    except ValueError:
        address = None
    if address is not None:
        host = str(address)
    return (url.scheme, host, port), address


class CredentialScope:
    """The places a target's credentials may go: its base URL's origin, the origins of the URLs its
    file writes for its nodes, and what its ``credential_hosts`` cover (module docstring)."""

    def __init__(self, base_url: str, named: Iterable[str] = (), allowed: Iterable[str] = ()):
        base = origin_of(URL(base_url))
        self.base = base[0] if base is not None else None
        self._named = {found[0] for url in named if (found := origin_of(URL(url))) is not None}
        self._rules = [parse_host_rule(entry) for entry in allowed]

    def place(self, url: URL) -> Place:
        """Return where ``url`` is: at the base URL's origin, elsewhere in scope, or outside (None)."""
        found = origin_of(url)
        if found is None:
            return None
        origin, address = found
        if origin == self.base:
            return "base"
        if origin in self._named or any(rule.covers(origin[1], address, origin[2]) for rule in self._rules):
            return "scope"
        return None

    def allows(self, url: str | URL) -> bool:
        """Return whether a request to ``url`` may carry a credential; an unparseable one may not."""
        try:
            return self.place(URL(url) if isinstance(url, str) else url) is not None
        except ValueError:
            return False


class Credentials:
    """A target's credentials and their scope: the ``Authorization`` of each request it makes.

    ``tenant_keys`` maps each tenant to its key (None: the engine takes none); ``worker_key`` is
    the target's worker credential (None: none stated), sent in place of a tenant's key to the
    origins in scope other than the base URL's, where the workers behind a gateway take their own.
    """

    def __init__(
        self, scope: CredentialScope, tenant_keys: Mapping[str, str | None], worker_key: str | None = None
    ):
        self.scope = scope
        self._tenants = {tenant: _bearer(key) for tenant, key in tenant_keys.items()}
        # Lookups (server info, tokenizing, metrics) go as the first tenant with a key: many
        # engines guard /v1/models.
        self._lookup = next((header for header in self._tenants.values() if header), {})
        self._worker = _bearer(worker_key)
        self._places: dict[tuple[str, str | None, int | None, bool], Place] = {}
        self.secrets = [key for key in (*tenant_keys.values(), worker_key) if key]

    def authorization(self, url: URL, tenant: str | None) -> dict[str, str]:
        """Return the ``Authorization`` header a request to ``url`` as ``tenant`` carries (None: a
        lookup, not a tenant's request): the tenant's key at the base URL's origin; the worker
        credential, where one is stated, else the tenant's key, elsewhere in scope; no header
        outside it. The dict returned is shared: never change it."""
        place = self._place(url)
        if place is None:
            return {}
        if place == "scope" and self._worker:
            return self._worker
        if tenant is None:
            return self._lookup
        return self._tenants.get(tenant, {})

    def _place(self, url: URL) -> Place:
        key = (url.scheme, url.raw_host, url.port, bool(url.raw_user or url.raw_password))
        if key not in self._places:
            if len(self._places) >= _MEMO_SIZE:
                self._places.clear()
            self._places[key] = self.scope.place(url)
        return self._places[key]


def _bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}
