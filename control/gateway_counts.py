"""What the web processes hold right now, counted across all of them.

Each web process reports, per replica, the requests it has in flight there, and per model, the
requests it holds waiting for the model to start. The reconciler reads the first (a replica
with a request in flight is never scaled down, evicted or idle-drained; a drain waits for it);
the gateway reads the second (``max_waiting`` bounds the waiters of all processes, not of
each). Rows carry the time their process last confirmed them: a process that stops reporting
(killed, frozen) has its counts ignored after :data:`STALE_AFTER_S`, so it cannot hold a replica
up or fill a model's queue for ever.

Two stores, chosen by configuration, like the gateway's limit counters: Redis when
``REDIS_URL`` is set (hashes keyed by replica or model, one field per process, and a key per
live process that expires), the database otherwise (:class:`control.models.GatewayCount`).
Where the one configured cannot be reached, nothing counts in the other meanwhile (the counts
would be split between two places, each too low): a report is sent again at the next
confirmation, a waiting slot is refused (the gateway answers 503 ``queue_unavailable``), and a
tick that cannot read what is in flight scales nothing down (``control.reconciler.runner``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import redis
from django.conf import settings
from django.db import transaction
from django.db.models import F, Sum
from django.db.models.functions import Greatest
from django.utils import timezone

from control.models import GatewayCount, ServedModel
from llmgw_site.config import counter_redis_options

logger = logging.getLogger(__name__)

# A live web process confirms its rows at least this often (its routing refresh loop)...
CONFIRM_EVERY_S = 5.0
# ...so rows not confirmed for this long belong to a process that is gone or frozen.
STALE_AFTER_S = 30.0

IN_FLIGHT = GatewayCount.Kind.IN_FLIGHT
WAITING = GatewayCount.Kind.WAITING


# --------------------------------------------------------------------------- Redis

# A live process's marker, and per subject a hash: field = process, value = its count.
_ALIVE = "llmgw:gw:alive:{process}"
_HASH = "llmgw:gw:{kind}:{subject}"

# Take a waiting slot: drop the fields of processes whose marker expired, sum the rest, and
# add one for this process only below the limit, in one atomic step.
_TAKE_LUA = """
local fields = redis.call('HGETALL', KEYS[1])
local total = 0
for i = 1, #fields, 2 do
  if redis.call('EXISTS', ARGV[4] .. fields[i]) == 1 then
    total = total + tonumber(fields[i + 1])
  else
    redis.call('HDEL', KEYS[1], fields[i])
  end
end
if total >= tonumber(ARGV[2]) then return 0 end
redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
redis.call('SET', KEYS[2], '1', 'EX', ARGV[3])
return 1
"""

_LEAVE_LUA = """
local left = redis.call('HINCRBY', KEYS[1], ARGV[1], -1)
if left <= 0 then redis.call('HDEL', KEYS[1], ARGV[1]) end
return left
"""

_redis: Any = None


def _client() -> Any:
    global _redis
    if _redis is None:
        _redis = redis.Redis.from_url(
            settings.REDIS_URL, **counter_redis_options(settings.LLMGW_STORE_WAIT)
        )
    return _redis


def _use_redis() -> bool:
    return bool(settings.REDIS_URL)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _redis_alive_prefix() -> str:
    return _ALIVE.format(process="")


# --------------------------------------------------------------------------- reporting


def report_in_flight(process: str, in_flight: Mapping[int, int]) -> None:
    """This process's requests in flight per replica, all of them (a replica it no longer
    lists has none here). Also confirms its waiting counts: the call is its heartbeat."""
    busy = {int(r): int(n) for r, n in in_flight.items() if n > 0}
    if _use_redis():
        client = _client()
        ttl = int(STALE_AFTER_S)
        pipe = client.pipeline(transaction=False)
        pipe.set(_ALIVE.format(process=process), "1", ex=ttl)
        # Which replicas this process listed last time, so it can take back what ended.
        index = f"llmgw:gw:listed:{IN_FLIGHT}:{process}"
        for replica_id in client.smembers(index):
            if int(replica_id) not in busy:
                pipe.hdel(_HASH.format(kind=IN_FLIGHT, subject=int(replica_id)), process)
        pipe.delete(index)
        for replica_id, count in busy.items():
            pipe.hset(_HASH.format(kind=IN_FLIGHT, subject=replica_id), process, count)
            pipe.expire(_HASH.format(kind=IN_FLIGHT, subject=replica_id), ttl)
            pipe.sadd(index, replica_id)
        pipe.expire(index, ttl)
        pipe.execute()
        return
    now = timezone.now()
    with transaction.atomic():
        mine = GatewayCount.objects.filter(process=process)
        mine.filter(kind=IN_FLIGHT).exclude(subject_id__in=list(busy)).delete()
        mine.filter(kind=WAITING, count=0).delete()
        mine.update(seen_at=now)
        for replica_id, count in busy.items():
            GatewayCount.objects.update_or_create(
                process=process,
                kind=IN_FLIGHT,
                subject_id=replica_id,
                defaults={"count": count, "seen_at": now},
            )
        # Rows of processes long gone: ignored already, removed now and then.
        GatewayCount.objects.filter(seen_at__lt=now - timedelta(seconds=4 * STALE_AFTER_S)).delete()


def in_flight_by_replica() -> dict[int, int]:
    """Requests in flight per replica, summed over the live web processes."""
    if _use_redis():
        client = _client()
        keys = [
            key
            for key in client.scan_iter(match=f"llmgw:gw:{IN_FLIGHT}:*", count=500)
            if _text(key).rsplit(":", 1)[1].isdigit()
        ]
        # Three round trips whatever the fleet's size: the keys, their fields, the markers.
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(key)
        fields: list[dict[Any, Any]] = pipe.execute()
        processes = sorted({_text(p) for counts in fields for p in counts})
        pipe = client.pipeline(transaction=False)
        for process in processes:
            pipe.exists(_ALIVE.format(process=process))
        alive = {p for p, live in zip(processes, pipe.execute(), strict=True) if live}
        out: dict[int, int] = {}
        for key, counts in zip(keys, fields, strict=True):
            total = sum(int(n) for p, n in counts.items() if _text(p) in alive)
            if total > 0:
                out[int(_text(key).rsplit(":", 1)[1])] = total
        return out
    fresh = timezone.now() - timedelta(seconds=STALE_AFTER_S)
    rows = (
        GatewayCount.objects.filter(kind=IN_FLIGHT, seen_at__gte=fresh, count__gt=0)
        .values("subject_id")
        .annotate(total=Sum("count"))
    )
    return {int(row["subject_id"]): int(row["total"]) for row in rows}


# --------------------------------------------------------------------------- waiting slots


def take_waiting_slot(process: str, model_id: int, limit: int) -> bool:
    """One more request of ``process`` waits for ``model_id`` to start, if fewer than
    ``limit`` wait in all live processes together. Atomic across processes."""
    if limit <= 0:
        return False
    if _use_redis():
        client = _client()
        script = client.register_script(_TAKE_LUA)
        taken = script(
            keys=[_HASH.format(kind=WAITING, subject=model_id), _ALIVE.format(process=process)],
            args=[process, limit, int(STALE_AFTER_S), _redis_alive_prefix()],
        )
        return bool(int(taken))
    now = timezone.now()
    fresh = now - timedelta(seconds=STALE_AFTER_S)
    with transaction.atomic():
        # The model's row is the lock every process takes before counting, so two processes
        # cannot both see room for one more (SQLite's write lock does the same there).
        locked = ServedModel.objects.select_for_update().filter(pk=model_id)
        if not list(locked.values_list("pk", flat=True)):
            return False
        waiting = (
            GatewayCount.objects.filter(
                kind=WAITING, subject_id=model_id, seen_at__gte=fresh
            ).aggregate(total=Sum("count"))["total"]
            or 0
        )
        if waiting >= limit:
            return False
        mine = GatewayCount.objects.filter(process=process, kind=WAITING, subject_id=model_id)
        if not mine.update(count=F("count") + 1, seen_at=now):
            GatewayCount.objects.create(
                process=process, kind=WAITING, subject_id=model_id, count=1, seen_at=now
            )
    return True


def leave_waiting_slot(process: str, model_id: int) -> None:
    """A request of ``process`` no longer waits for ``model_id`` (started, failed or gone)."""
    if _use_redis():
        client = _client()
        client.register_script(_LEAVE_LUA)(
            keys=[_HASH.format(kind=WAITING, subject=model_id)], args=[process]
        )
        return
    GatewayCount.objects.filter(process=process, kind=WAITING, subject_id=model_id).update(
        count=Greatest(F("count") - 1, 0), seen_at=timezone.now()
    )


def waiting_for(model_id: int) -> int:
    """Requests waiting for ``model_id`` in all live processes (for status pages and tests)."""
    if _use_redis():
        client = _client()
        return sum(
            int(count)
            for process, count in client.hgetall(
                _HASH.format(kind=WAITING, subject=model_id)
            ).items()
            if client.exists(
                _ALIVE.format(process=process.decode() if isinstance(process, bytes) else process)
            )
        )
    fresh = timezone.now() - timedelta(seconds=STALE_AFTER_S)
    total = GatewayCount.objects.filter(
        kind=WAITING, subject_id=model_id, seen_at__gte=fresh
    ).aggregate(total=Sum("count"))["total"]
    return int(total or 0)
