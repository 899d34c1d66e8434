from __future__ import annotations

from django.apps import AppConfig


class AdminApiConfig(AppConfig):
    """The operators' API (``/api/admin/v1/``) and the admin tokens that open it."""

    name = "llmgw_site.admin_api"
    label = "admin_api"
    verbose_name = "Admin API"
