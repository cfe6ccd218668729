"""Who sent a request: its API key, as a tenant. Everything the gateway keeps (answers kept for X-Request-Id, joins
onto a running request, video jobs, /recent) belongs to the tenant that made it, and each tenant sees its own;
admin keys (http.api_key, http.api_keys entries with admin: true) see every tenant's. Without keys there is one
tenant, "". A tenant is a hash of its key: the key itself is never kept beside what it made, nor logged."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from disagg.settings.schema import ApiKey, HttpSettings

#: hex digits of a key's hash that name its tenant (also the prefix of its requests' ids at the orchestrator)
TENANT_HEX = 12
#: the orchestrator's request ids: at most this long (disagg/transport/wire/descriptors.py Id)
MAX_ID = 128


@dataclass(frozen=True)
class Caller:
    """A request's tenant ("" without keys), whether it sees every tenant's work, and the highest priority its
    requests may ask (None: any)."""

    tenant: str = ""
    admin: bool = False
    priority_cap: int | None = None

    def sees(self, tenant: str) -> bool:
        return self.admin or tenant == self.tenant


#: a request of a gateway without keys, and one on a route open without a key
NOBODY = Caller()


def tenant_of(key: str) -> str:
    return hashlib.sha256(b"disagg-http-key\0" + key.encode()).hexdigest()[:TENANT_HEX]


class Keys:
    """The keys a gateway takes (http.api_key, http.api_keys), each as the Caller its requests are."""

    def __init__(self, h: HttpSettings):
        self.entries: list[tuple[bytes, Caller]] = []
        for key, spec in h.api_keys.items():
            spec = spec if isinstance(spec, ApiKey) else ApiKey(priority=spec)
            self.entries.append((key.encode(), Caller(tenant_of(key), spec.admin, spec.priority)))
        if h.api_key:  # after the tiered keys: one that is both counts as tiered, as it always did
            self.entries.append((h.api_key.encode(), Caller(tenant_of(h.api_key), True, None)))
        self.required = bool(self.entries)
        #: the tenants there can be: what per-tenant quotas divide
        self.tenants = len({c.tenant for _, c in self.entries}) or 1

    def caller(self, authorization: bytes) -> Caller | None:
        """The Caller of an `Authorization: Bearer KEY` header's value; None for a missing or wrong key."""
        if not self.required:
            return NOBODY
        scheme, _, given = authorization.strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        given = given.strip()
        found = None
        for key, caller in self.entries:  # every key compared, in constant time each
            if hmac.compare_digest(given, key) and found is None:
                found = caller
        return found


def upstream_id(caller: Caller, request_id: str) -> str:
    """The id a tenant's request has at the orchestrator: its own id under the tenant's prefix, so that two
    tenants' equal X-Request-Ids are two requests (one HTTP gateway is one client of the orchestrator). Without
    keys, the id as it is. An id too long for the prefix is replaced by its hash."""
    if not caller.tenant:
        return request_id
    rid = f"{caller.tenant}@{request_id}"
    if len(rid) > MAX_ID:
        rid = f"{caller.tenant}@{hashlib.sha256(request_id.encode()).hexdigest()}"
    return rid
