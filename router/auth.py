"""Who a request is: its API key, the tenant the key belongs to, and what it may reach.

Three kinds of endpoint (`path_kind`):
- `api`: generation, `/v1/models`. With an API key or tenant keys configured, a request
  needs one of them (or the admin key).
- `admin`: `/flush_cache`, `/stats` (cache control and per-engine cache figures). With an
  admin key configured only the admin key opens them; without one, what opens `api`.
- `probe`: `/health`, `/ready`, `/metrics`. Open unless `probe_auth` says otherwise:
  `metrics` puts `/metrics` behind the admin key (or, without one, any valid key); `all`
  also puts `/health` and `/ready` behind any valid key.

Keys are compared by their blake2b digests (a dict lookup of a digest: the time it takes
says nothing about the key's bytes) and the single keys with `hmac.compare_digest`.

Tenants (`--tenant-keys FILE`, `load_tenant_keys`): each key maps to a tenant; the cache
salt a tenant's request carries is derived from the tenant and the client's own salt
(`tenant_salt`), so no tenant can hit, or learn of, another tenant's prefix. A request may
name a shared namespace (`cache_namespace`) that its tenant is allowed (the key file's
`shared=` list, or the router's `--shared-cache-namespace`): its salt is then derived from
that namespace alone, the same for every tenant that names it.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from pathlib import Path

TENANT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
PROBE_AUTH = ("open", "metrics", "all")
PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})
ADMIN_PATHS = frozenset({"/flush_cache", "/stats"})


@dataclass(frozen=True, slots=True)
class TenantKey:
    """One line of a tenant key file: the key, its tenant, the shared namespaces it may use."""

    key: str
    tenant: str
    shared: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.key or any(c.isspace() for c in self.key):
            raise ValueError("a tenant key must be non-empty and have no whitespace")
        for name in (self.tenant, *self.shared):
            if not TENANT_NAME.fullmatch(name):
                raise ValueError(
                    f"tenant and namespace names are 1-64 of [A-Za-z0-9._-], got {name!r}"
                )

    def __repr__(self) -> str:  # never the key (configs get logged)
        return f"TenantKey(tenant={self.tenant!r}, shared={self.shared!r})"


@dataclass(frozen=True, slots=True)
class Identity:
    """What a request's key proved: `admin` (the admin key), and its tenant (None: the
    single API key, or no key at all)."""

    admin: bool = False
    tenant: TenantKey | None = None
    authenticated: bool = False


ANONYMOUS = Identity()


def load_tenant_keys(path: str | Path) -> tuple[TenantKey, ...]:
    """The tenant key file: one `KEY TENANT [shared=NS[,NS...]]` per line; blank lines and
    lines starting with `#` are skipped. Raises ValueError naming the line at fault (never
    the key)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"--tenant-keys {path}: {e.strerror}") from None
    out: list[TenantKey] = []
    seen: set[str] = set()
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        where = f"--tenant-keys {path}: line {number}"
        if len(words) not in (2, 3) or (len(words) == 3 and not words[2].startswith("shared=")):
            raise ValueError(f"{where}: expected 'KEY TENANT [shared=NS,...]'")
        shared = (
            tuple(n for n in words[2][len("shared=") :].split(",") if n) if len(words) == 3 else ()
        )
        try:
            entry = TenantKey(words[0], words[1], shared)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        if entry.key in seen:
            raise ValueError(f"{where}: this key is already on an earlier line")
        seen.add(entry.key)
        out.append(entry)
    if not out:
        raise ValueError(f"--tenant-keys {path}: no keys")
    return tuple(out)


def _digest(key: str) -> bytes:
    return hashlib.blake2b(key.encode(), digest_size=32, person=b"hc-api-key").digest()


class KeyRing:
    """The router's keys; `identify` maps a bearer token to an `Identity`."""

    def __init__(
        self,
        api_key: str | None,
        admin_key: str | None,
        tenants: tuple[TenantKey, ...],
        probe_auth: str = "open",
    ) -> None:
        self._api = api_key.encode() if api_key else None
        self._admin = admin_key.encode() if admin_key else None
        self._tenants = {_digest(t.key): t for t in tenants}
        self.probe_auth = probe_auth

    @property
    def api_protected(self) -> bool:
        return self._api is not None or bool(self._tenants)

    def identify(self, token: str | None) -> Identity | None:
        """The identity `token` proves; None for a token that is no key of ours."""
        if token is None:
            return None
        raw = token.encode()
        if self._admin is not None and hmac.compare_digest(raw, self._admin):
            return Identity(admin=True, authenticated=True)
        if self._api is not None and hmac.compare_digest(raw, self._api):
            return Identity(authenticated=True)
        tenant = self._tenants.get(_digest(token))
        return None if tenant is None else Identity(tenant=tenant, authenticated=True)

    def required(self, path: str) -> str:
        """What `path` needs: "none", "key" (any valid key) or "admin"."""
        if path in PROBE_PATHS:
            if self.probe_auth == "all" or (self.probe_auth == "metrics" and path == "/metrics"):
                if path == "/metrics" and self._admin is not None:
                    return "admin"
                return "key" if self.api_protected or self._admin is not None else "none"
            return "none"
        if path in ADMIN_PATHS and self._admin is not None:
            return "admin"
        return "key" if self.api_protected else "none"


def tenant_salt(tenant: str, client_salt: str) -> str:
    """The cache salt of a tenant's request: no client salt can equal another tenant's."""
    return "t." + _salt_digest(b"hc-tenant-salt", tenant, client_salt)


def shared_salt(namespace: str, client_salt: str) -> str:
    """The cache salt of a request in shared namespace `namespace` (any tenant alike)."""
    return "s." + _salt_digest(b"hc-shared-salt", namespace, client_salt)


def _salt_digest(person: bytes, name: str, client_salt: str) -> str:
    h = hashlib.blake2b(digest_size=16, person=person)
    for part in (name, client_salt):
        data = part.encode()
        h.update(len(data).to_bytes(4, "big") + data)
    return h.hexdigest()
