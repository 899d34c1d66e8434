"""The gateway's data: API keys, static upstream endpoints and one usage row per request."""

from __future__ import annotations

from django.conf import settings
from django.contrib.auth.models import Group
from django.core.exceptions import ValidationError
from django.db import models
from django.utils import timezone

from gateway.addresses import upstream_url_problem


class ApiKey(models.Model):
    """A bearer key for ``/v1``, owned by a user.

    The key itself is shown once at creation; only its prefix (to recognise it) and its SHA-256
    (to check it) are stored. Empty ``allowed_models`` means every model.
    """

    class BudgetPeriod(models.TextChoices):
        DAY = "day", "day"
        WEEK = "week", "week"
        MONTH = "month", "month"

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    name = models.CharField(max_length=100, blank=True)
    prefix = models.CharField(max_length=20, unique=True, editable=False)
    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    allowed_models = models.JSONField(default=list, blank=True)
    rpm_limit = models.PositiveIntegerField(null=True, blank=True, help_text="Requests per minute.")
    tpm_limit = models.PositiveIntegerField(null=True, blank=True, help_text="Tokens per minute.")
    token_budget = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="Tokens per budget period."
    )
    budget_period = models.CharField(
        max_length=10, choices=BudgetPeriod.choices, default=BudgetPeriod.MONTH
    )
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True, editable=False)
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.name or self.user})"


class Limits(models.Model):
    """Limits as a user's or a team's: the same fields a key has. A key's effective limits are
    the narrowest of its own, its owner's and its owner's teams' (``gateway.identity.keys``); a
    user's or team's budget counts spend across all their keys."""

    allowed_models = models.JSONField(
        default=list, blank=True, help_text='Model names, e.g. ["llama3"]; empty: every model.'
    )
    rpm_limit = models.PositiveIntegerField(null=True, blank=True, help_text="Requests per minute.")
    tpm_limit = models.PositiveIntegerField(null=True, blank=True, help_text="Tokens per minute.")
    token_budget = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="Tokens per budget period."
    )
    budget_period = models.CharField(
        max_length=10, choices=ApiKey.BudgetPeriod.choices, default=ApiKey.BudgetPeriod.MONTH
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        abstract = True


class UserLimits(Limits):
    """One person's limits, over every key they hold, and whether they may make keys."""

    user = models.OneToOneField(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="llmgw_limits"
    )
    self_service = models.BooleanField(
        default=True, help_text="May make their own keys at /account/."
    )

    class Meta:
        verbose_name = "user limits"
        verbose_name_plural = "user limits"

    def __str__(self) -> str:
        return f"limits of {self.user}"


class TeamLimits(Limits):
    """A team's (a Django group's) limits, over every key its members hold."""

    team = models.OneToOneField(Group, on_delete=models.CASCADE, related_name="llmgw_limits")

    class Meta:
        verbose_name = "team limits"
        verbose_name_plural = "team limits"

    def __str__(self) -> str:
        return f"limits of team {self.team}"


class Endpoint(models.Model):
    """A static upstream (an engine llmgw does not run) for router-only deployments."""

    slug = models.SlugField(max_length=100, unique=True, help_text="The endpoint's id.")
    url = models.URLField(max_length=500, help_text="Base URL, e.g. http://10.0.0.5:8000.")
    model_names = models.JSONField(default=list, help_text="Model names this endpoint serves.")
    weight = models.PositiveIntegerField(default=1)
    enabled = models.BooleanField(default=True)
    allow_private_address = models.BooleanField(
        default=False,
        help_text="Allow link-local and metadata addresses (refused unless set on purpose).",
    )
    created_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug

    def save(self, *args: object, **kwargs: object) -> None:
        # Refused at save time whatever the path (admin, shell, fixtures), not only in forms.
        self.clean()
        super().save(*args, **kwargs)  # type: ignore[arg-type]

    def clean(self) -> None:
        problem = upstream_url_problem(self.url)
        if problem and not self.allow_private_address:
            raise ValidationError({"url": f"This URL {problem}."})


class UsageSource(models.TextChoices):
    """Where a usage row's token counts came from."""

    ENGINE = "engine", "reported by the engine"
    TOKENIZED = "tokenized", "counted by the engine's tokenizer"
    ESTIMATED = "estimated", "estimated (no tokenizer answered)"
    NONE = "", "none"


class UsageRecord(models.Model):
    """One row per request, keyed by its request id so a replayed write cannot count twice."""

    Source = UsageSource

    class FinishReason(models.TextChoices):
        STOP = "stop", "stop"
        LENGTH = "length", "length"
        TOOL_CALLS = "tool_calls", "tool calls"
        CONTENT_FILTER = "content_filter", "content filter"
        CLIENT_DISCONNECT = "client_disconnect", "client disconnected"
        UPSTREAM_ERROR = "upstream_error", "upstream error"
        TIMEOUT = "timeout", "timeout"
        INTERRUPTED = "interrupted", "interrupted (gateway stopped)"
        ERROR = "error", "error"
        NONE = "", "none"

    request_id = models.CharField(max_length=64, unique=True)
    api_key = models.ForeignKey(
        ApiKey, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    model = models.CharField(max_length=200, db_index=True)
    endpoint = models.CharField(max_length=200, blank=True, help_text="API route, e.g. chat.")
    upstream = models.CharField(max_length=300, blank=True, help_text="Replica or endpoint id.")
    status = models.PositiveSmallIntegerField()
    stream = models.BooleanField(default=False)
    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    cached_tokens = models.PositiveIntegerField(default=0)
    usage_source = models.CharField(
        max_length=10,
        choices=UsageSource.choices,
        blank=True,
        default="",
        help_text="Where the token counts came from (empty: nothing was generated).",
    )
    ttft_ms = models.FloatField(null=True, blank=True)
    duration_ms = models.FloatField(default=0)
    finish_reason = models.CharField(
        max_length=30, choices=FinishReason.choices, blank=True, default=""
    )
    started_at = models.DateTimeField(db_index=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-started_at"]
        indexes = [
            models.Index(fields=["api_key", "started_at"], name="usage_key_started"),
            # /account/'s latest requests and a user's budget read by user, newest first.
            models.Index(fields=["user", "started_at"], name="usage_user_started"),
        ]

    def __str__(self) -> str:
        return f"{self.request_id} {self.model} {self.status}"


class UsageRollup(models.Model):
    """Usage summed per hour, key, user, model and status: what dashboards, budgets and
    reports read for hours that are over (``gateway.ledger.rollups``), so they stay fast however
    many raw rows there are. Kept after the raw rows expire. Key and user are plain ids
    (0: none), not foreign keys: a rollup outlives the key it counts."""

    hour = models.DateTimeField()
    key_id = models.BigIntegerField(default=0)
    user_id = models.BigIntegerField(default=0)
    model = models.CharField(max_length=200)
    status = models.PositiveSmallIntegerField()
    requests = models.BigIntegerField(default=0)
    prompt_tokens = models.BigIntegerField(default=0)
    completion_tokens = models.BigIntegerField(default=0)
    cached_tokens = models.BigIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["hour", "key_id", "user_id", "model", "status"], name="rollup_unique"
            )
        ]
        indexes = [
            models.Index(fields=["user_id", "hour"], name="rollup_user_hour"),
            models.Index(fields=["key_id", "hour"], name="rollup_key_hour"),
        ]

    def __str__(self) -> str:
        return f"{self.hour:%Y-%m-%d %H}h {self.model} {self.status}: {self.requests}"


class RollupMark(models.Model):
    """How far the rollups reach: every hour before ``rolled_through`` is in UsageRollup;
    readers add raw rows from there on."""

    name = models.CharField(max_length=40, primary_key=True)
    rolled_through = models.DateTimeField()

    def __str__(self) -> str:
        return f"{self.name}: {self.rolled_through}"


class LimitCounter(models.Model):
    """One rate-limit window of one key (requests or tokens), for the store-backed limiter.

    Used only when no Redis is configured. Reservations are single guarded upserts
    (``gateway.identity.limits``), so several web processes sharing the store cannot overshoot.
    """

    name = models.CharField(max_length=120, primary_key=True)
    used = models.BigIntegerField(default=0)
    window_end = models.FloatField(help_text="Unix time after which the row may be deleted.")

    def __str__(self) -> str:
        return f"{self.name}={self.used}"


class SignInPace(models.Model):
    """How fast passwords may be tried for one account, from all addresses together
    (``gateway.identity.pacing``): the account's next attempt is due at ``due_at`` (the
    theoretical arrival time of the generic cell rate algorithm). A row whose ``due_at`` has
    passed means the same as no row, so such rows are deleted whenever convenient."""

    username = models.CharField(max_length=255, unique=True)
    due_at = models.DateTimeField(db_index=True)

    class Meta:
        verbose_name = "sign-in pace"

    def __str__(self) -> str:
        return f"{self.username}: next attempt due {self.due_at:%Y-%m-%d %H:%M:%S}"


class SignInLink(models.Model):
    """A one-time sign-in link for one user, printed by ``manage.py signin_link``: the way in
    for an administrator whose password sign-in is locked or paced. Only the token's SHA-256 is
    stored; the link works once, until ``expires_at``."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    token_hash = models.CharField(max_length=64, unique=True, editable=False)
    created_by = models.CharField(max_length=200, help_text="Who printed it.")
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    expires_at = models.DateTimeField()
    used_at = models.DateTimeField(null=True, blank=True, editable=False)

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "one-time sign-in link"

    def __str__(self) -> str:
        state = "used" if self.used_at else f"until {self.expires_at:%Y-%m-%d %H:%M}"
        return f"sign-in link for {self.user} ({state})"


class SsoIdentity(models.Model):
    """Who a user is at a single sign-on provider: its issuer, and the subject (``sub``) it
    names them by, bound at their first sign-in through it (``gateway.identity.sso_accounts``).
    Sign-ins are matched on this alone: names and emails at a provider change, and at some
    providers anybody chooses them."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="sso_identities"
    )
    issuer = models.CharField(max_length=255)
    subject = models.CharField(max_length=255)
    created_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        verbose_name = "single sign-on identity"
        verbose_name_plural = "single sign-on identities"
        constraints = [
            models.UniqueConstraint(
                fields=["issuer", "subject"], name="gateway_one_account_per_sso_subject"
            ),
            models.UniqueConstraint(
                fields=["issuer", "user"], name="gateway_one_sso_subject_per_account"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.user} is {self.subject} at {self.issuer}"


class SsoLinkName(models.Model):
    """The name at the single sign-on provider that an operator gave a provisioned account: the
    first sign-in whose ``preferred_username`` it is binds the account, once (the row then
    goes). For providers whose names are the operator's to give and that vouch for no email."""

    user = models.OneToOneField(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="sso_link_name"
    )
    provider_username = models.CharField(max_length=255, unique=True)
    created_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        verbose_name = "single sign-on link name"

    def __str__(self) -> str:
        return f"{self.user} is linked by the provider's {self.provider_username!r}"
