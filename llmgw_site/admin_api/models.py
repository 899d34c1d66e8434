"""Admin tokens: what a program shows to use the admin API.

Like API keys, a token is shown once when it is issued; only its visible prefix (to recognise
it in lists and logs) and its SHA-256 (to check it) are stored. A read-only token may only
read; a read-write token may change what a superuser could change in the admin.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone


class AdminToken(models.Model):
    """A bearer token for ``/api/admin/``, scoped read-only or read-write."""

    class Scope(models.TextChoices):
        READ = "read", "read-only"
        WRITE = "write", "read-write"

    name = models.CharField(max_length=100, help_text="What uses it, e.g. ci-catalog.")
    scope = models.CharField(max_length=10, choices=Scope.choices, default=Scope.READ)
    prefix = models.CharField(max_length=24, unique=True, editable=False)
    token_hash = models.CharField(max_length=64, unique=True, editable=False)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        editable=False,
        related_name="+",
    )
    expires_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)
    revoked_at = models.DateTimeField(null=True, blank=True, editable=False)

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "admin token"

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.name}, {self.scope})"
