from django.contrib import admin
from django.urls import path

from control.views import healthz
from gateway.api import api as gateway_api

urlpatterns = [
    path("v1/", gateway_api.urls),
    path("healthz", healthz, name="healthz"),
    path("admin/", admin.site.urls),
]
