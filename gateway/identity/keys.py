"""API keys: issue (shown once, stored as a SHA-256), check (cached in-process), revoke.

A key is ``llmgw-`` followed by 43 URL-safe characters (256 bits); the first 14 characters are
stored as the prefix, so operators can tell keys apart without the secret, and the database
keeps only the hash, so a leaked dump reveals no key (``credentials.bearer`` mints, hashes and
checks them, and says why a plain SHA-256 is the right hash).

Checking a key must not cost a database round trip on a warm request: lookups (hits and
misses) are cached in-process for ``LLMGW_KEY_CACHE_TTL`` seconds, so a revocation or an edit
reaches every web process within that time. That bound holds whatever the store does: a key no
load has confirmed within it is refused with 503 (the gateway cannot confirm keys now; the key
may well be valid, so not 401) and counted in ``llmgw_keys_unconfirmed``, until the store
answers again. Expiry is compared on every request against the cached expiry, so it takes
effect to the second.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import DatabaseError, transaction
from django.utils import timezone

from credentials.bearer import BearerSecret
from gateway import dbthread
from gateway.errors import ApiError
from gateway.models import ApiKey, TeamLimits, UserLimits
from telemetry import metrics

logger = logging.getLogger(__name__)

API_KEY: Final = BearerSecret("llmgw-", shown=8)
KEY_PREFIX: Final = API_KEY.marker
PREFIX_LENGTH: Final = API_KEY.prefix_length
hash_key: Final = API_KEY.hash
well_formed: Final = API_KEY.well_formed
# Bounds the cache against a flood of random keys; overflowing clears it (cheap, rare).
_CACHE_MAX = 50_000
# How long a request for a key seen before waits for its reload once the key is past its TTL:
# past that the store is slow or away, and the key, not confirmed, is refused (503).
KNOWN_KEY_WAIT_S = 0.5
# A key a request used within this long is kept loaded (see KeyCache), up to this many (the
# most recently used): each reload is four queries a 500 keys, every third of the TTL. The
# batch that reloads them runs at most every MIN_REFRESH_S, whatever the TTL.
KEEP_WARM_S = 120.0
KEEP_WARM_MAX = 2_000
MIN_REFRESH_S = 0.5


@dataclass(frozen=True)
class Scope:
    """One holder of limits a request counts against: the key, its owner, or one of the
    owner's teams. ``name`` names its counters, so every key of a user (or of a team's
    members) takes from the same ones, in every web process."""

    name: str  # "key:<prefix>", "user:<id>" or "team:<id>"
    owner: str  # as a refusal names it: "this key", "your account", "team 'ml'"
    rpm_limit: int | None = None
    tpm_limit: int | None = None
    token_budget: int | None = None
    budget_period: str = ApiKey.BudgetPeriod.MONTH

    @property
    def limited(self) -> bool:
        return not (self.rpm_limit is None and self.tpm_limit is None and self.token_budget is None)


@dataclass(frozen=True)
class KeyInfo:
    """What the request path needs to know about a key; plain data, safe to cache."""

    id: int
    user_id: int
    prefix: str
    allowed_models: frozenset[str]  # the narrowest of the key's, owner's and teams' lists
    rpm_limit: int | None  # the key's own limits (its owner's and teams' are in ``scopes``)
    tpm_limit: int | None
    token_budget: int | None
    budget_period: str
    expires_at: float | None  # Unix time
    revoked: bool
    models_limited: bool = False  # False: every model (an empty list set nowhere)
    scopes: tuple[Scope, ...] = ()  # every holder with a limit, the key first

    def usable(self, now: float) -> bool:
        return not self.revoked and (self.expires_at is None or now < self.expires_at)

    def may_use(self, model: str) -> bool:
        if not self.models_limited:
            return not self.allowed_models or model in self.allowed_models
        return model in self.allowed_models


def narrowest_models(lists: list[list[str]]) -> tuple[bool, frozenset[str]]:
    """(limited, names) from the model lists of a key, its owner and teams (pure): every
    non-empty list narrows; none at all means every model."""
    sets = [frozenset(str(m) for m in names) for names in lists if names]
    if not sets:
        return False, frozenset()
    return True, frozenset.intersection(*sets)


@dataclass(frozen=True)
class IssuedKey:
    key: str  # shown once, never stored
    api_key: ApiKey


def issue(
    username: str,
    *,
    name: str = "",
    models: list[str] | None = None,
    expires_at: datetime | None = None,
    rpm: int | None = None,
    tpm: int | None = None,
    budget: int | None = None,
    budget_period: str = ApiKey.BudgetPeriod.MONTH,
) -> IssuedKey:
    """Create a key for an existing user. The returned ``key`` is the only copy there is."""
    user = get_user_model().objects.get(username=username)
    new = API_KEY.issue()
    with transaction.atomic():
        api_key = ApiKey.objects.create(
            user=user,
            name=name,
            prefix=new.prefix,
            key_hash=new.hash,
            allowed_models=sorted(set(models or [])),
            rpm_limit=rpm,
            tpm_limit=tpm,
            token_budget=budget,
            budget_period=budget_period,
            expires_at=expires_at,
        )
    return IssuedKey(new.secret, api_key)


def revoke(key_id: int) -> bool:
    """Revoke a key; True if this call revoked it (a second call changes nothing)."""
    return (
        ApiKey.objects.filter(pk=key_id, revoked_at__isnull=True).update(revoked_at=timezone.now())
        == 1
    )


def parse_expiry(text: str, *, now: datetime | None = None) -> datetime:
    """``2027-01-01`` (midnight UTC), an ISO timestamp, or a duration like ``30d``/``12h``."""
    now = now or timezone.now()
    match = re.fullmatch(r"(\d+)([dhm])", text.strip())
    if match:
        amount, unit = int(match.group(1)), match.group(2)
        delta = {"d": timedelta(days=amount), "h": timedelta(hours=amount)}.get(
            unit, timedelta(minutes=amount)
        )
        return now + delta
    parsed = datetime.fromisoformat(text.strip())
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=timezone.get_current_timezone())
    return parsed


def _load(key_hash: str) -> KeyInfo | None:
    return _load_many([key_hash]).get(key_hash)


def _prepare_lookup() -> None:
    _load_many(["0" * 64])
    _owners({0})  # no user has id 0: the owner's queries run, and find nothing


# A batch's hashes go into one IN (...) list up to this many (SQLite allows 32,766 variables).
_BATCH = 500


def _load_many(key_hashes: list[str]) -> dict[str, KeyInfo | None]:
    """What the store says of each key now; None for a hash no key has. Runs in a lane of
    gateway.dbthread: four queries for up to ``_BATCH`` keys, each on its own tables rather
    than one join of them all (for the reason in control.serving.routing_snapshot: no lock
    cycle with DDL or TRUNCATE)."""
    found: dict[str, KeyInfo | None] = dict.fromkeys(key_hashes)
    for at in range(0, len(key_hashes), _BATCH):
        rows = list(
            ApiKey.objects.filter(key_hash__in=key_hashes[at : at + _BATCH])
            .order_by()
            .values_list(
                "key_hash",
                "id",
                "user_id",
                "prefix",
                "allowed_models",
                "rpm_limit",
                "tpm_limit",
                "token_budget",
                "budget_period",
                "expires_at",
                "revoked_at",
            )
        )
        owners = _owners({row[2] for row in rows})
        for key_hash, *row in rows:
            found[key_hash] = _key_info(row, owners)
    return found


@dataclass(frozen=True)
class _Owner:
    active: bool
    scopes: list[tuple[list[str], Scope]]  # the owner's and teams' (model list, scope) each


def _owners(user_ids: set[int]) -> dict[int, _Owner]:
    """Whether each user is active, and their own and their teams' limits."""
    if not user_ids:
        return {}
    active = dict(get_user_model().objects.filter(pk__in=user_ids).values_list("pk", "is_active"))
    scopes: dict[int, list[tuple[list[str], Scope]]] = {user_id: [] for user_id in user_ids}
    own = UserLimits.objects.filter(user_id__in=user_ids).values_list("user_id", *_LIMIT_FIELDS)
    for user_id, models, rpm, tpm, budget, period in own:
        scope = Scope(f"user:{user_id}", "your account", rpm, tpm, budget, period)
        scopes[user_id].append((list(models or []), scope))
    teams = TeamLimits.objects.filter(team__user__id__in=user_ids).values_list(
        "team__user__id", "team_id", "team__name", *_LIMIT_FIELDS
    )
    for user_id, team_id, name, models, rpm, tpm, budget, period in teams:
        scope = Scope(f"team:{team_id}", f"team '{name}'", rpm, tpm, budget, period)
        scopes[user_id].append((list(models or []), scope))
    # A user deleted meanwhile is an inactive owner: the key stops working like a revoked one.
    return {u: _Owner(active.get(u, False), scopes[u]) for u in user_ids}


def _key_info(row: list[Any], owners: dict[int, _Owner]) -> KeyInfo:
    (id_, user_id, prefix, models, rpm, tpm, budget, period, expires, revoked) = row
    owner = owners.get(user_id) or _Owner(False, [])
    key_scope = Scope(f"key:{prefix}", "this key", rpm, tpm, budget, period)
    limited, allowed = narrowest_models([list(models or []), *(m for m, _ in owner.scopes)])
    return KeyInfo(
        id=id_,
        user_id=user_id,
        prefix=prefix,
        allowed_models=allowed,
        rpm_limit=rpm,
        tpm_limit=tpm,
        token_budget=budget,
        budget_period=period,
        expires_at=expires.timestamp() if expires else None,
        # A deactivated (or deleted) owner's keys stop working like revoked ones.
        revoked=revoked is not None or not owner.active,
        models_limited=limited,
        scopes=tuple(s for s in (key_scope, *(s for _, s in owner.scopes)) if s.limited),
    )


_LIMIT_FIELDS = ("allowed_models", "rpm_limit", "tpm_limit", "token_budget", "budget_period")


class KeyCache:
    """Hash → (KeyInfo or None, loaded at). Misses are cached too, so a flood of bad keys
    cannot turn into a flood of queries.

    An entry is trusted for ``LLMGW_KEY_CACHE_TTL`` seconds; past that a lookup waits for a
    fresh load, so a revocation takes effect within the TTL; if that load fails (the store is
    unreachable), the key is refused with 503 rather than trusted longer. So that no request
    waits for the database on a key in use, the keys requests used within ``KEEP_WARM_S`` are
    reloaded together, in one batch, every third of the TTL (``_keep_warm``): measured under ``make
    bench``, a stream whose key had just aged out waited 3-5 ms more for its first token (the
    key's queries in the database thread), the slowest first token in a hundred. A key used
    less often than the TTL but within ``KEEP_WARM_S`` is in that set too, so its request is
    not that one. And should the batch fall behind, a request that finds its entry past half
    of the TTL still gets the cached answer and reloads it behind it (once).

    One key is loaded once at a time, however many of its requests miss together: when
    1,000 streams opened at once on a fresh process, each ran the key's three queries (70% of
    the process's samples were that, in its one database thread) while the first streams'
    tokens waited.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._entries: dict[str, tuple[KeyInfo | None, float]] = {}
        self._clock = clock
        self._loading: dict[str, asyncio.Task[KeyInfo | None]] = {}
        self._used: dict[str, float] = {}  # hash of a valid key -> when a request last used it
        self._warmer: asyncio.Task[None] | None = None
        self._warmer_loop: asyncio.AbstractEventLoop | None = None

    async def lookup(self, key: str) -> KeyInfo | None:
        key_hash = hash_key(key)
        entry = self._entries.get(key_hash)
        now = self._clock()
        ttl = float(settings.LLMGW_KEY_CACHE_TTL)
        if entry is not None and now - entry[1] < ttl:
            if entry[0] is not None:
                self._used[key_hash] = now
            if now - entry[1] >= ttl / 2:
                self._load(key_hash)  # behind the answer: a reload already running is reused
            return entry[0]
        try:
            if entry is not None:
                # A key seen before waits only so long for its reload: past that the store is
                # slow or away; the reload carries on, and the key, not confirmed within its
                # TTL, is refused below.
                loading = self._load(key_hash)
                done, _ = await asyncio.wait({loading}, timeout=KNOWN_KEY_WAIT_S)
                if not done:
                    raise DatabaseError("the key's reload did not answer in time")
                return loading.result()
            # Shielded: a waiter whose client hangs up must not cancel the others' load.
            return await asyncio.shield(self._load(key_hash))
        except DatabaseError:
            # The store is down. A batch reload that got through meanwhile still counts.
            fresh = self._entries.get(key_hash)
            if fresh is not None and self._clock() - fresh[1] < ttl:
                return fresh[0]
            # Trusting the last answer longer would let a key revoked since keep working for as
            # long as the outage lasts: refused, with 503, not 401 (the key may well be valid).
            metrics.observe_key_unconfirmed(known=entry is not None)
            raise ApiError(
                503,
                "The gateway cannot confirm API keys right now; try again shortly.",
                "key_unconfirmed",
                retry_after=5,
            ) from None

    def _load(self, key_hash: str) -> asyncio.Task[KeyInfo | None]:
        """The load of ``key_hash`` in flight, started if none is."""
        task = self._loading.get(key_hash)
        if task is None:
            loop = asyncio.get_running_loop()
            if self._warmer is None or self._warmer_loop is not loop or self._warmer.done():
                self._warmer_loop = loop
                self._warmer = loop.create_task(self._keep_warm(), name="llmgw-key-refresh")
            task = loop.create_task(self._load_and_store(key_hash))
            self._loading[key_hash] = task
            task.add_done_callback(lambda done: self._loaded(key_hash, done))
        return task

    async def _load_and_store(self, key_hash: str) -> KeyInfo | None:
        loaded_at = self._clock()
        info = await dbthread.for_request(_load, key_hash)
        self._store(key_hash, info, loaded_at)
        if info is not None:
            self._used[key_hash] = loaded_at
        return info

    async def prepare(self) -> None:
        """Look up a hash no key has: the request lane opens its connection to the store and
        the lookup's queries are built once before the first client's key needs them
        (docs/decisions.md, '/v1 prepared at startup'). Nothing is cached; raises what the
        store raises."""
        await dbthread.for_request(_prepare_lookup)

    async def _keep_warm(self) -> None:
        while True:
            ttl = float(settings.LLMGW_KEY_CACHE_TTL)
            await asyncio.sleep(max(ttl / 3, MIN_REFRESH_S))
            try:
                await self.refresh_in_use()
            except DatabaseError:
                pass  # the entries age; past their TTL the outage policy in lookup() applies
            except Exception:
                logger.exception("reloading the API keys in use failed")

    async def refresh_in_use(self) -> int:
        """Reload, in one batch, the valid keys requests used within ``KEEP_WARM_S`` (the
        ``KEEP_WARM_MAX`` most recent); forget the use of the others. Returns how many keys
        were reloaded."""
        now = self._clock()
        self._used = {
            key_hash: at
            for key_hash, at in self._used.items()
            if now - at < KEEP_WARM_S and self._entries.get(key_hash, (None, 0.0))[0] is not None
        }
        due = [key_hash for key_hash in self._used if key_hash not in self._loading]
        if len(due) > KEEP_WARM_MAX:
            due = sorted(due, key=self._used.__getitem__)[-KEEP_WARM_MAX:]
        if not due:
            return 0
        found = await dbthread.in_background(_load_many, due)
        for key_hash, info in found.items():
            self._store(key_hash, info, now)
        return len(found)

    def _loaded(self, key_hash: str, task: asyncio.Task[KeyInfo | None]) -> None:
        if self._loading.get(key_hash) is task:
            del self._loading[key_hash]
        error = None if task.cancelled() else task.exception()
        # A background reload has no waiter: a store that is down is the outage policy's
        # business once the entry ages out; anything else is a fault to see in the log.
        if error is not None and not isinstance(error, DatabaseError):
            logger.error("loading an API key failed", exc_info=error)

    def _store(self, key_hash: str, info: KeyInfo | None, loaded_at: float) -> None:
        current = self._entries.get(key_hash)
        if current is not None and current[1] > loaded_at:
            return  # a load that began later has stored what the store says now
        if len(self._entries) >= _CACHE_MAX:
            self._entries.clear()
        self._entries[key_hash] = (info, loaded_at)

    async def settled(self) -> None:
        """Wait for the loads in flight (tests)."""
        while self._loading:
            await asyncio.gather(*self._loading.values(), return_exceptions=True)

    def clear(self) -> None:
        self._entries.clear()
        self._used.clear()


cache = KeyCache()


async def authenticate(authorization: str | None) -> KeyInfo | None:
    """The key behind an ``Authorization: Bearer`` header if it is valid now, else None."""
    if not authorization or not authorization.startswith(("Bearer ", "bearer ")):
        return None
    key = authorization[7:].strip()
    # Malformed keys are refused without hashing or a lookup.
    if not well_formed(key):
        return None
    info = await cache.lookup(key)
    if info is None or not info.usable(time.time()):
        return None
    return info
