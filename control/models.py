"""The control plane's data: the catalog (profiles, models), the fleet (nodes, GPUs), what runs
where (replicas, shards), the leadership lease and the audit trail.

Desired state (what operators and the reconciler want) and observed state (what agents report)
live in separate fields; the admin lets operators edit only the former.
"""

from __future__ import annotations

import secrets
from datetime import UTC, datetime

from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator
from django.db import models
from django.utils import timezone


class Engine(models.TextChoices):
    VLLM = "vllm", "vLLM"
    SGLANG = "sglang", "SGLang"
    LLAMACPP = "llamacpp", "llama.cpp server"
    SIM = "sim", "sim (simulated engine)"


class Profile(models.Model):
    """How to run a model: the engine, its argument template, and what one replica needs.

    ``shards_per_replica`` > 1 spans several nodes (ranks 0..n-1, rank 0 is the head).
    ``gpu_memory_mib`` is what one GPU of a shard must have free.
    """

    name = models.SlugField(max_length=100, unique=True)
    engine = models.CharField(max_length=20, choices=Engine.choices, default=Engine.SIM)
    args = models.JSONField(
        default=list,
        blank=True,
        help_text="Argument template, a list of strings; {model}, {source}, {port}, {host}, "
        "{rank}, {world_size} and {head_address} are filled in per shard.",
    )
    env = models.JSONField(default=dict, blank=True, help_text="Extra environment variables.")
    gpus_per_shard = models.PositiveSmallIntegerField(default=1)
    shards_per_replica = models.PositiveSmallIntegerField(default=1)
    gpu_memory_mib = models.PositiveIntegerField(
        default=0, help_text="GPU memory one GPU of a shard needs free, in MiB."
    )
    gpu_selector = models.JSONField(
        default=dict,
        blank=True,
        help_text='Node labels a placement requires, e.g. {"gpu": "h100"}.',
    )

    class Strategy(models.TextChoices):
        BINPACK = "binpack", "bin-pack (fill the fullest node that fits)"
        SPREAD = "spread", "spread (use the emptiest node)"

    placement_strategy = models.CharField(
        max_length=10, choices=Strategy.choices, default=Strategy.BINPACK
    )
    health_path = models.CharField(max_length=200, default="/health")
    startup_timeout_s = models.PositiveIntegerField(default=600)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(shards_per_replica__gte=1), name="profile_at_least_one_shard"
            ),
        ]

    def __str__(self) -> str:
        return self.name


class ServedModel(models.Model):
    """A catalog entry: the model name clients ask for, and how many replicas it may have.

    ``min_replicas`` 0 means scale-from-zero: the first request creates demand and the
    reconciler places a replica. ``pinned`` models are never evicted to make room.
    """

    name = models.CharField(max_length=200, unique=True, help_text="The API name clients send.")
    aliases = models.JSONField(default=list, blank=True)
    source = models.CharField(max_length=500, help_text="Repository id or path of the weights.")
    profiles = models.ManyToManyField(Profile, related_name="models", blank=True)
    default_profile = models.ForeignKey(Profile, on_delete=models.PROTECT, related_name="+")
    min_replicas = models.PositiveSmallIntegerField(default=0)
    max_replicas = models.PositiveSmallIntegerField(default=1)
    idle_timeout_s = models.PositiveIntegerField(
        default=900, help_text="Scale down to the minimum after this long without requests."
    )
    pinned = models.BooleanField(default=False)
    activation_timeout_s = models.PositiveIntegerField(
        default=600, help_text="How long a request may wait for a cold model to start."
    )
    max_waiting = models.PositiveIntegerField(
        default=100, help_text="Requests that may wait for activation at once."
    )
    connect_timeout_s = models.FloatField(null=True, blank=True)
    first_byte_timeout_s = models.FloatField(null=True, blank=True)
    stream_idle_timeout_s = models.FloatField(null=True, blank=True)
    context_length = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Tokens the model takes, prompt and output together. Empty: what its engine "
        "reports (max_model_len).",
    )
    enabled = models.BooleanField(default=True)
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    # Observed: written by the gateway (coalesced), read by the reconciler.
    last_request_at = models.DateTimeField(null=True, blank=True, editable=False)
    demand_at = models.DateTimeField(
        null=True, blank=True, editable=False, help_text="A request found no ready replica."
    )
    # Observed: written by the reconciler when a wanted replica cannot be placed.
    placement_note = models.TextField(
        blank=True, editable=False, help_text="Why a wanted replica could not be placed."
    )

    class Meta:
        ordering = ["name"]
        verbose_name = "model"
        constraints = [
            models.CheckConstraint(
                condition=models.Q(min_replicas__lte=models.F("max_replicas")),
                name="model_min_replicas_within_max",
            ),
        ]

    def __str__(self) -> str:
        return self.name


class ProfileScale(models.Model):
    """How many replicas a model runs under one of its other profiles (not the default, whose
    counts are the model's own), and that profile's observed demand.

    A model runs under several profiles at once: clients ask for ``name@profile`` to be
    served only by that profile's replicas. Without a row, another profile runs 0 to 1
    replicas, started by demand.
    """

    model = models.ForeignKey(ServedModel, on_delete=models.CASCADE, related_name="scales")
    profile = models.ForeignKey(Profile, on_delete=models.CASCADE, related_name="scales")
    min_replicas = models.PositiveSmallIntegerField(default=0)
    max_replicas = models.PositiveSmallIntegerField(default=1)
    # Observed, as on the model: a request for name@profile found no ready replica, and when
    # the last one was served (written by the gateway and the reconciler).
    demand_at = models.DateTimeField(null=True, blank=True, editable=False)
    last_request_at = models.DateTimeField(null=True, blank=True, editable=False)

    class Meta:
        verbose_name = "replicas under another profile"
        verbose_name_plural = "replicas under other profiles"
        constraints = [
            models.UniqueConstraint(fields=["model", "profile"], name="profile_scale_one_row"),
            models.CheckConstraint(
                condition=models.Q(min_replicas__lte=models.F("max_replicas")),
                name="profile_scale_min_within_max",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.model.name}@{self.profile.name}"

    def clean(self) -> None:
        if self.model_id and self.profile_id and self.profile_id == self.model.default_profile_id:
            raise ValidationError(
                {"profile": "The default profile's replica counts are the model's own."}
            )


class Node(models.Model):
    """A registered agent and the machine it runs on.

    ``schedule`` is what the operator wants (active, cordoned: no new placements, draining:
    move everything away); ``health`` is what heartbeats show.
    """

    class Schedule(models.TextChoices):
        ACTIVE = "active", "active"
        CORDONED = "cordoned", "cordoned"
        DRAINING = "draining", "draining"

    class Health(models.TextChoices):
        NEW = "new", "new (never connected)"
        READY = "ready", "ready"
        UNREACHABLE = "unreachable", "unreachable"
        LOST = "lost", "lost"

    name = models.SlugField(max_length=100, unique=True)
    addresses = models.JSONField(default=list, blank=True)
    labels = models.JSONField(default=dict, blank=True)
    schedule = models.CharField(max_length=20, choices=Schedule.choices, default=Schedule.ACTIVE)
    health = models.CharField(
        max_length=20, choices=Health.choices, default=Health.NEW, editable=False
    )
    last_heartbeat_at = models.DateTimeField(null=True, blank=True, editable=False)
    agent_version = models.CharField(max_length=50, blank=True, editable=False)
    boot_id = models.CharField(max_length=100, blank=True, editable=False)
    # The node token is shown once at issue; only its hash is kept.
    token_prefix = models.CharField(max_length=20, blank=True, editable=False)
    token_hash = models.CharField(max_length=64, blank=True, editable=False, db_index=True)
    token_issued_at = models.DateTimeField(null=True, blank=True, editable=False)
    # The serial number of the one client certificate that is this node's identity on the
    # gRPC listener (``manage.py issue_node_cert``); empty: none valid (never issued, or
    # revoked). A certificate whose serial is not this one is refused, so issuing a new
    # certificate revokes the old one.
    cert_serial = models.CharField(max_length=64, blank=True, editable=False, db_index=True)
    cert_issued_at = models.DateTimeField(null=True, blank=True, editable=False)
    # Desired: weights (names relative to the agent's weights directory) the agent should
    # delete once no shard uses them.
    remove_weights = models.JSONField(default=list, blank=True)
    # Bumped (with a nudge) by every change to this node's desired state; the agent reports
    # the revision it has applied, so "delivered" is visible.
    desired_revision = models.BigIntegerField(default=0, editable=False)
    observed_revision = models.BigIntegerField(default=0, editable=False)
    # Observed, from the agent: the ports its engines may use, what it did with
    # remove_weights, and how many stale (lower-epoch) desired states it refused.
    port_min = models.PositiveIntegerField(null=True, blank=True, editable=False)
    port_max = models.PositiveIntegerField(null=True, blank=True, editable=False)
    weights_report = models.JSONField(default=list, blank=True, editable=False)
    stale_desired_rejected = models.PositiveIntegerField(default=0, editable=False)
    # The highest leader epoch the agent reported having seen (hello): the leader keeps its
    # lease's epoch above it, or the agent would refuse its desired state.
    agent_epoch = models.BigIntegerField(default=0, editable=False)
    # Observed at hello: the agent's stream came over loopback, so it runs on the control
    # plane's host and may advertise loopback addresses (see control.agent_peers). No other
    # node's loopback address is routed.
    connected_over_loopback = models.BooleanField(default=False, editable=False)
    created_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def state(self) -> str:
        """The one word operators read: an unhealthy node shows its health, else its schedule."""
        if self.health in (self.Health.UNREACHABLE, self.Health.LOST, self.Health.NEW):
            return str(self.health)
        return "ready" if self.schedule == self.Schedule.ACTIVE else str(self.schedule)


class Gpu(models.Model):
    """One device of a node, as its agent reported it."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="gpus")
    index = models.PositiveSmallIntegerField()
    uuid = models.CharField(max_length=100, blank=True)
    model = models.CharField(max_length=100, blank=True)
    memory_total_mib = models.PositiveIntegerField(default=0)
    memory_used_mib = models.PositiveIntegerField(default=0)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["node", "index"]
        verbose_name = "GPU"
        constraints = [
            models.UniqueConstraint(fields=["node", "index"], name="gpu_unique_index_per_node"),
        ]

    def __str__(self) -> str:
        return f"{self.node.name}/gpu{self.index}"


class FailureClass(models.TextChoices):
    NONE = "", "none"
    OOM = "oom", "out of memory"
    BAD_ARGS = "bad_args", "bad arguments"
    DOWNLOAD = "download", "download failed"
    CRASH = "crash", "crashed"
    HEALTH_TIMEOUT = "health_timeout", "health check timed out"


def new_engine_key() -> str:
    """A replica's engine API key: 256 random bits (only the gateway and the agent see it)."""
    return "llmgw_engine_" + secrets.token_urlsafe(32)


class Replica(models.Model):
    """One running copy of a model under one profile, made of one shard per node it spans.

    ``desired`` is the reconciler's intent; ``observed`` comes from the agents' reports.
    ``epoch`` is the leader epoch that last changed the desired state (agents reject lower).
    """

    class Desired(models.TextChoices):
        RUNNING = "running", "running"
        DRAINING = "draining", "draining"
        STOPPED = "stopped", "stopped"

    class Observed(models.TextChoices):
        # Not yet started
        PENDING = "pending", "pending"
        # Running
        STARTING = "starting", "starting"
        READY = "ready", "ready"
        DRAINING = "draining", "draining"
        # Finished
        STOPPED = "stopped", "stopped"
        FAILED = "failed", "failed"

    model = models.ForeignKey(ServedModel, on_delete=models.CASCADE, related_name="replicas")
    profile = models.ForeignKey(Profile, on_delete=models.PROTECT, related_name="replicas")
    desired = models.CharField(max_length=20, choices=Desired.choices, default=Desired.RUNNING)
    observed = models.CharField(
        max_length=20, choices=Observed.choices, default=Observed.PENDING, editable=False
    )
    failures = models.PositiveIntegerField(default=0, editable=False)
    failure_class = models.CharField(
        max_length=20, choices=FailureClass.choices, blank=True, default="", editable=False
    )
    backoff_until = models.DateTimeField(null=True, blank=True, editable=False)
    generation = models.PositiveIntegerField(default=1, editable=False)
    epoch = models.BigIntegerField(default=0, editable=False)
    # The engine's API key: sent to the agent in desired state, by the gateway with every
    # request; the engine refuses calls without it.
    engine_key = models.CharField(max_length=64, default=new_engine_key, editable=False, blank=True)
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    ready_at = models.DateTimeField(null=True, blank=True, editable=False)
    # When the last request on it finished (reported by the gateway): idle time and eviction's
    # least-recently-used order count from it.
    last_request_at = models.DateTimeField(null=True, blank=True, editable=False)
    # Set when it is told to drain. While the gateway still has requests in flight on it (and
    # the drain timeout has not passed) its agent is sent "running", not "drain": the engine
    # is not asked to stop under a request its own metrics may not show.
    draining_since = models.DateTimeField(null=True, blank=True, editable=False)
    drain_held = models.BooleanField(default=False, editable=False)

    class Meta:
        ordering = ["model", "id"]

    def __str__(self) -> str:
        return f"{self.model.name}#{self.pk}"


class Shard(models.Model):
    """The part of a replica on one node: its GPUs, its port and its rank."""

    replica = models.ForeignKey(Replica, on_delete=models.CASCADE, related_name="shards")
    node = models.ForeignKey(Node, on_delete=models.PROTECT, related_name="shards")
    rank = models.PositiveSmallIntegerField(default=0)
    gpu_indices = models.JSONField(default=list, blank=True)
    port = models.PositiveIntegerField()
    observed = models.CharField(
        max_length=20,
        choices=Replica.Observed.choices,
        default=Replica.Observed.PENDING,
        editable=False,
    )
    exit_code = models.IntegerField(null=True, blank=True, editable=False)
    failure_class = models.CharField(
        max_length=20, choices=FailureClass.choices, blank=True, default="", editable=False
    )
    last_log = models.TextField(blank=True, editable=False)
    # The agent's one-line account of the last transition ("exited with code 1 ...").
    message = models.CharField(max_length=500, blank=True, editable=False)
    # Engine load from its metrics, as the agent last reported it (None: not published).
    requests_running = models.PositiveIntegerField(null=True, blank=True, editable=False)
    requests_waiting = models.PositiveIntegerField(null=True, blank=True, editable=False)
    # The engine's KV cache capacity in tokens, as its metrics say (None: not published, or an
    # agent too old to tell): the gateway remembers no more of a replica's cache than this.
    cache_tokens = models.PositiveIntegerField(null=True, blank=True, editable=False)
    updated_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        ordering = ["replica", "rank"]
        constraints = [
            models.UniqueConstraint(fields=["replica", "rank"], name="shard_unique_rank"),
        ]

    def __str__(self) -> str:
        return f"{self.replica}/rank{self.rank}@{self.node.name}:{self.port}"


# Shards in these observed states hold their GPUs and port whatever is desired: the process
# may be running. A shard the agent never started, or reported stopped or failed, holds nothing
# once its replica is desired stopped.
LIVE_SHARD_STATES = frozenset(
    {Replica.Observed.STARTING, Replica.Observed.READY, Replica.Observed.DRAINING}
)


class Lease(models.Model):
    """The leadership row. Only ``control.leases`` writes it, in single guarded statements.

    Times are the database clock in milliseconds since the Unix epoch (see ``control.dbclock``),
    so no host's clock decides who leads.
    """

    name = models.CharField(max_length=100, primary_key=True)
    owner = models.CharField(max_length=200, blank=True)
    epoch = models.BigIntegerField(default=0)
    expires_at_ms = models.BigIntegerField(default=0)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=models.Q(epoch__gte=0), name="lease_epoch_not_negative"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} (epoch {self.epoch})"

    @property
    def expires_at(self) -> datetime:
        return datetime.fromtimestamp(self.expires_at_ms / 1000, tz=UTC)


class GatewayCount(models.Model):
    """What one web process holds now: requests in flight on a replica, or requests waiting
    for a model to start. Written by ``control.gateway_counts`` only (when Redis is not set);
    a process that stops confirming its rows (``seen_at``) has them ignored, then removed."""

    class Kind(models.TextChoices):
        IN_FLIGHT = "in_flight", "in flight on a replica"
        WAITING = "waiting", "waiting for a model to start"

    process = models.CharField(max_length=200)
    kind = models.CharField(max_length=20, choices=Kind.choices)
    # A replica's id (in flight) or a model's id (waiting): no foreign key, so a count never
    # blocks deleting either, and a stale one is harmless.
    subject_id = models.BigIntegerField()
    count = models.PositiveIntegerField(default=0)
    seen_at = models.DateTimeField()

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["process", "kind", "subject_id"], name="gateway_count_one_row"
            ),
        ]
        indexes = [models.Index(fields=["kind", "subject_id"], name="gateway_count_subject")]

    def __str__(self) -> str:
        return f"{self.process} {self.kind} #{self.subject_id}: {self.count}"


class StreamCounter(models.Model):
    """How many streams one node opened in one window, where every web process and agent
    listener counts them (``control.stream_limits``). Used only when Redis is not set; rows of
    windows that have ended are deleted now and then."""

    # "streams:<node id>:<window number>": one row per node and window, taken by an upsert.
    name = models.CharField(max_length=80, primary_key=True)
    used = models.PositiveIntegerField(default=0)
    window_end = models.FloatField(help_text="Unix time after which the row may be deleted.")

    def __str__(self) -> str:
        return f"{self.name}={self.used}"


class Event(models.Model):
    """Append-only audit of what the control plane decided and why."""

    class Kind(models.TextChoices):
        LEADERSHIP = "leadership", "leadership"
        PLACEMENT = "placement", "placement"
        LIFECYCLE = "lifecycle", "lifecycle"
        NODE = "node", "node"
        OPERATOR = "operator", "operator"

    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    kind = models.CharField(max_length=20, choices=Kind.choices)
    subject = models.CharField(max_length=200, help_text="What it is about, e.g. model/llama3.")
    message = models.TextField()
    epoch = models.BigIntegerField(default=0)
    data = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.created_at:%Y-%m-%d %H:%M:%S} {self.subject}: {self.message}"
