"""``/admin/diagnostics/``'s paths (included by ``llmgw_site.urls``, before the admin's own)."""

from django.contrib import admin
from django.urls import path

from llmgw_site.diagnostics import views

urlpatterns = [
    path("", admin.site.admin_view(views.page), name="diagnostics"),
    path("processes", views.processes, name="diagnostics-processes"),
    path("processes.txt", views.processes, {"text": True}),
    path("stacks", views.stacks, name="diagnostics-stacks"),
    path("stacks.txt", views.stacks, {"text": True}, name="diagnostics-stacks-text"),
    path("profile", views.profile, name="diagnostics-profile"),
    path("profile.svg", views.profile, {"form": "svg"}, name="diagnostics-profile-svg"),
    path("profile.folded", views.profile, {"form": "folded"}, name="diagnostics-profile-folded"),
    path("profile.txt", views.profile, {"form": "txt"}, name="diagnostics-profile-text"),
    path("heap", views.heap, name="diagnostics-heap"),
    path("heap.txt", views.heap, {"text": True}, name="diagnostics-heap-text"),
    path("objects", views.objects, name="diagnostics-objects"),
    path("objects.txt", views.objects, {"text": True}, name="diagnostics-objects-text"),
]
