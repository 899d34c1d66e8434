from django.contrib import admin
from django.urls import include, path

from control.views import healthz
from gateway.edge.api import api as gateway_api
from llmgw_site import sso
from llmgw_site.admin_api.api import api as admin_api
from llmgw_site.views import dashboard_data, metrics_view

# The admin's registrations (every app's admin.py), here rather than when the apps are ready:
# see INSTALLED_APPS. Django's system checks load this URLconf, so they check them as before.
admin.autodiscover()

urlpatterns = [
    path("v1/", gateway_api.urls),
    path("api/admin/v1/", admin_api.urls),
    path("healthz", healthz, name="healthz"),
    path("metrics", metrics_view, name="metrics"),
    # Before admin.site.urls, whose catch-all would take it; staff-only, checked in the view.
    path("admin/dashboard.json", dashboard_data, name="admin-dashboard-data"),
    path("admin/", admin.site.urls),
    path("account/", include("gateway.identity.account")),
    # Single sign-on (OpenID Connect): 404 unless configured.
    path("oidc/authenticate/", sso.Authenticate.as_view(), name="oidc_authentication_init"),
    path("oidc/callback/", sso.Callback.as_view(), name="oidc_authentication_callback"),
    path("signed-in/", sso.signed_in, name="signed-in"),
]
