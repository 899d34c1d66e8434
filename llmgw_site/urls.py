"""The site's URLconf: what Django serves behind ``llmgw_site.asgi`` (``Answer.SITE`` in
``llmgw_site.listeners``). ``/v1`` and ``/healthz`` are answered before Django, each in one
place: ``/v1`` by ``gateway.edge.asgi.V1App`` (its ninja operations on ``gateway.edge.v1_urls``),
``/healthz`` by ``llmgw_site.asgi.healthz``."""

from django.contrib import admin
from django.urls import include, path

from llmgw_site import sso
from llmgw_site.admin_api.api import api as admin_api
from llmgw_site.views import dashboard_data, metrics_view

# The admin's registrations (every app's admin.py), here rather than when the apps are ready:
# see INSTALLED_APPS. Django's system checks load this URLconf, so they check them as before.
admin.autodiscover()

urlpatterns = [
    path("api/admin/v1/", admin_api.urls),
    path("metrics", metrics_view, name="metrics"),
    # Before admin.site.urls, whose catch-all would take it; staff-only, checked in the view.
    path("admin/dashboard.json", dashboard_data, name="admin-dashboard-data"),
    # Every process's stacks, profiles and heap: staff or an admin token, in the view.
    path("admin/diagnostics/", include("llmgw_site.diagnostics.urls")),
    path("admin/", admin.site.urls),
    path("account/", include("gateway.identity.account")),
    # Single sign-on (OpenID Connect): 404 unless configured.
    path("oidc/authenticate/", sso.Authenticate.as_view(), name="oidc_authentication_init"),
    path("oidc/callback/", sso.Callback.as_view(), name="oidc_authentication_callback"),
    path("signed-in/", sso.signed_in, name="signed-in"),
]
