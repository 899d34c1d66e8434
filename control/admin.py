"""The control plane in the Django admin, which is the operations console.

Operators edit desired state (the catalog, node labels, which weights to remove); observed
state (what agents and the reconciler write) is read-only here. Changes with consequences
(cordon, drain, undrain, restart, node tokens) are actions that call one domain function each
(``control.operations``, ``control.node_tokens``), which records an Event and tells the agents.

The admin index is the cluster dashboard (``templates/admin/index.html``); its data comes
from ``llmgw_site.views.dashboard_data``, polled by the page.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from django import forms
from django.contrib import admin, messages
from django.db.models import Count, Q, QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse

from agents.protocol.names import valid_weights_name
from control import node_certs, node_tokens, nudges, operations, profiles
from control.models import (
    Event,
    Gpu,
    Lease,
    Node,
    Profile,
    ProfileScale,
    Replica,
    ServedModel,
    Shard,
)

_Record = TypeVar("_Record", Lease, Event)

admin.site.site_header = "llmgw"
admin.site.site_title = "llmgw"
admin.site.index_title = "Cluster"
# "View site" leads staff to their own keys and usage; llmgw has no other public page.
admin.site.site_url = "/account/"


def actor(request: HttpRequest) -> str:
    """Who did it, for the audit trail."""
    return f"admin:{request.user.get_username()}"


# --------------------------------------------------------------------------- the catalog


class ProfileForm(forms.ModelForm[Profile]):
    class Meta:
        model = Profile
        fields = [f.name for f in Profile._meta.concrete_fields if f.editable and f.name != "id"]

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        assert data is not None
        problems = profiles.wire_problems(
            args=data.get("args", []),
            env=data.get("env", {}),
            health_path=data.get("health_path", "/health"),
            gpu_selector=data.get("gpu_selector", {}),
        )
        for field, message in problems.items():
            if field in self.fields:
                self.add_error(field, message)
        return data


@admin.register(Profile)
class ProfileAdmin(admin.ModelAdmin[Profile]):
    """Profiles. The environment holds secrets (``HF_TOKEN``): a superuser sees and edits it;
    everybody else sees it masked and cannot change it, since changing it (``HF_ENDPOINT``)
    could send the secrets elsewhere."""

    form = ProfileForm
    list_display = [
        "name",
        "engine",
        "gpus_per_shard",
        "shards_per_replica",
        "gpu_memory_mib",
        "placement_strategy",
    ]
    list_filter = ["engine"]
    search_fields = ["name"]

    def get_fields(self, request: HttpRequest, obj: Profile | None = None) -> Any:
        fields = [f for f in super().get_fields(request, obj) if f != "masked_env"]
        if getattr(request.user, "is_superuser", False):
            return fields
        return ["masked_env" if f == "env" else f for f in fields]

    def get_readonly_fields(self, request: HttpRequest, obj: Profile | None = None) -> list[str]:
        readonly = list(super().get_readonly_fields(request, obj))
        return (
            readonly if getattr(request.user, "is_superuser", False) else [*readonly, "masked_env"]
        )

    @admin.display(description="env")
    def masked_env(self, obj: Profile) -> str:
        return json.dumps(profiles.masked_env(obj.env or {}), indent=2)

    # Django's delete pages refuse a profile in use before they get here (the models' PROTECT);
    # InUse is a replica placed under it in between, said instead of a server error.
    def delete_model(self, request: HttpRequest, obj: Profile) -> None:
        self._delete(request, [obj.pk])

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Profile]) -> None:
        self._delete(request, list(queryset.values_list("pk", flat=True)))

    def _delete(self, request: HttpRequest, pks: list[int]) -> None:
        for pk in pks:
            try:
                operations.delete_profile(pk, actor=actor(request))
            except operations.InUse as exc:
                self.message_user(request, exc.message, messages.ERROR)


class ProfileScaleInline(admin.TabularInline[ProfileScale, ServedModel]):
    """Replica counts under the model's other profiles (the default's are the model's own)."""

    model = ProfileScale
    extra = 0
    fields = ["profile", "min_replicas", "max_replicas", "demand_at", "last_request_at"]
    readonly_fields = ["demand_at", "last_request_at"]


@admin.register(ServedModel)
class ServedModelAdmin(admin.ModelAdmin[ServedModel]):
    inlines = [ProfileScaleInline]
    list_display = [
        "name",
        "default_profile",
        "min_replicas",
        "max_replicas",
        "replicas_ready",
        "idle_timeout_s",
        "pinned",
        "enabled",
        "pending_because",
    ]
    list_filter = ["enabled", "pinned"]
    search_fields = ["name", "source", "aliases"]
    filter_horizontal = ["profiles"]
    readonly_fields = ["created_at", "last_request_at", "demand_at", "placement_note"]
    fieldsets = [
        (None, {"fields": ["name", "aliases", "source", "enabled"]}),
        ("How it runs", {"fields": ["default_profile", "profiles", "context_length"]}),
        (
            "Scaling",
            {
                "fields": [
                    "min_replicas",
                    "max_replicas",
                    "idle_timeout_s",
                    "pinned",
                    "activation_timeout_s",
                    "max_waiting",
                ]
            },
        ),
        (
            "Deadlines (empty: the gateway's defaults)",
            {"fields": ["connect_timeout_s", "first_byte_timeout_s", "stream_idle_timeout_s"]},
        ),
        (
            "Observed",
            {"fields": ["placement_note", "last_request_at", "demand_at", "created_at"]},
        ),
    ]

    def get_queryset(self, request: HttpRequest) -> QuerySet[ServedModel]:
        running = Q(replicas__desired=Replica.Desired.RUNNING)
        return (
            super()
            .get_queryset(request)
            .select_related("default_profile")
            .annotate(
                n_desired=Count("replicas", filter=running),
                n_ready=Count(
                    "replicas", filter=running & Q(replicas__observed=Replica.Observed.READY)
                ),
            )
        )

    actions = ["pin", "unpin"]

    def save_model(self, request: HttpRequest, obj: ServedModel, form: Any, change: bool) -> None:
        # Scaling and pinning are operator decisions with an audit trail: they go through the
        # same functions as the commands and the admin API, before the rest of the form.
        if change and {"min_replicas", "max_replicas"} & set(form.changed_data):
            operations.scale_model(
                obj.pk,
                min_replicas=obj.min_replicas,
                max_replicas=obj.max_replicas,
                actor=actor(request),
            )
        if change and "pinned" in form.changed_data:
            operations.pin_model(obj.pk, pinned=obj.pinned, actor=actor(request))
        super().save_model(request, obj, form, change)

    def delete_model(self, request: HttpRequest, obj: ServedModel) -> None:
        operations.delete_model(obj.pk, actor=actor(request))

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[ServedModel]) -> None:
        for pk in list(queryset.values_list("pk", flat=True)):
            operations.delete_model(pk, actor=actor(request))

    @admin.action(description="Pin: never evict to make room", permissions=["change"])
    def pin(self, request: HttpRequest, queryset: QuerySet[ServedModel]) -> None:
        done = [
            m.name
            for m in queryset
            if operations.pin_model(m.pk, pinned=True, actor=actor(request))
        ]
        self.message_user(request, f"Pinned: {', '.join(done) or 'nothing new'}.", messages.SUCCESS)

    @admin.action(description="Unpin", permissions=["change"])
    def unpin(self, request: HttpRequest, queryset: QuerySet[ServedModel]) -> None:
        done = [
            m.name
            for m in queryset
            if operations.pin_model(m.pk, pinned=False, actor=actor(request))
        ]
        self.message_user(
            request, f"Unpinned: {', '.join(done) or 'nothing new'}.", messages.SUCCESS
        )

    @admin.display(description="ready / desired")
    def replicas_ready(self, obj: ServedModel) -> str:
        return f"{getattr(obj, 'n_ready', 0)} / {getattr(obj, 'n_desired', 0)}"

    @admin.display(description="pending because")
    def pending_because(self, obj: ServedModel) -> str:
        return obj.placement_note or "—"


# --------------------------------------------------------------------------- nodes


class GpuInline(admin.TabularInline[Gpu, Node]):
    model = Gpu
    extra = 0
    can_delete = False
    fields = [
        "index",
        "uuid",
        "model",
        "memory_total_mib",
        "memory_used_mib",
        "updated_at",
    ]
    readonly_fields = [
        "index",
        "uuid",
        "model",
        "memory_total_mib",
        "memory_used_mib",
        "updated_at",
    ]

    def has_add_permission(self, request: HttpRequest, obj: Node | None = None) -> bool:
        return False


class NodeForm(forms.ModelForm[Node]):
    class Meta:
        model = Node
        fields = ["name", "addresses", "labels", "remove_weights"]

    def clean_remove_weights(self) -> list[str]:
        names = self.cleaned_data.get("remove_weights") or []
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise forms.ValidationError('A list of weight folder names, e.g. ["llama-3-8b"].')
        bad = [n for n in names if not valid_weights_name(n)]
        if bad:
            raise forms.ValidationError(
                f"Not a relative path inside the weights directory: {', '.join(bad)}"
            )
        return names

    def clean_labels(self) -> dict[str, str]:
        labels = self.cleaned_data.get("labels") or {}
        if not isinstance(labels, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in labels.items()
        ):
            raise forms.ValidationError('Labels map names to strings, e.g. {"gpu": "h100"}.')
        return labels


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin[Node]):
    form = NodeForm
    list_display = [
        "name",
        "state",
        "schedule",
        "health",
        "gpu_count",
        "last_heartbeat_at",
        "agent_version",
        "token_prefix",
    ]
    list_filter = ["schedule", "health"]
    search_fields = ["name"]
    inlines = [GpuInline]
    actions = ["cordon", "drain", "undrain", "issue_token", "revoke_token", "revoke_cert"]
    readonly_fields = [
        "schedule",
        "health",
        "last_heartbeat_at",
        "agent_version",
        "boot_id",
        "connected_over_loopback",
        "token_prefix",
        "token_issued_at",
        "cert_serial",
        "cert_issued_at",
        "desired_revision",
        "observed_revision",
        "port_min",
        "port_max",
        "weights_report",
        "stale_desired_rejected",
        "created_at",
    ]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Node]:
        return super().get_queryset(request).annotate(n_gpus=Count("gpus"))

    @admin.display(description="GPUs")
    def gpu_count(self, obj: Node) -> int:
        return int(getattr(obj, "n_gpus", 0))

    def save_model(self, request: HttpRequest, obj: Node, form: Any, change: bool) -> None:
        # The admin wraps this in a transaction; the nudge goes out after it commits.
        super().save_model(request, obj, form, change)
        if change and "remove_weights" in form.changed_data:
            nudges.nudge_node(obj.pk)

    def _each(
        self,
        request: HttpRequest,
        queryset: QuerySet[Node],
        verb: str,
        change: Any,
    ) -> None:
        done = [node.name for node in queryset if change(node.pk, actor=actor(request))]
        if done:
            self.message_user(request, f"{verb}: {', '.join(done)}.", messages.SUCCESS)
        else:
            self.message_user(request, f"Nothing to do: already {verb}.", messages.INFO)

    @admin.action(description="Cordon: no new placements", permissions=["change"])
    def cordon(self, request: HttpRequest, queryset: QuerySet[Node]) -> None:
        self._each(request, queryset, "cordoned", operations.cordon_node)

    @admin.action(description="Drain: move replicas away", permissions=["change"])
    def drain(self, request: HttpRequest, queryset: QuerySet[Node]) -> None:
        self._each(request, queryset, "draining", operations.drain_node)

    @admin.action(description="Undrain: schedulable again", permissions=["change"])
    def undrain(self, request: HttpRequest, queryset: QuerySet[Node]) -> None:
        self._each(request, queryset, "active", operations.undrain_node)

    @admin.action(description="Issue a new node token (shown once)", permissions=["change"])
    def issue_token(self, request: HttpRequest, queryset: QuerySet[Node]) -> HttpResponse | None:
        if queryset.count() != 1:
            self.message_user(request, "Issue tokens one node at a time.", messages.ERROR)
            return None
        node = queryset.get()
        token = node_tokens.issue_node_token(node.name)
        # Rendered into this response only: the token is stored nowhere but the agent's host.
        response = TemplateResponse(
            request,
            "admin/control/node/token_issued.html",
            {
                **self.admin_site.each_context(request),
                "title": f"Node token for {node.name}",
                "node": node,
                "token": token,
                "opts": self.opts,
            },
        )
        response["Cache-Control"] = "no-store"
        return response

    @admin.action(description="Revoke the node token", permissions=["change"])
    def revoke_token(self, request: HttpRequest, queryset: QuerySet[Node]) -> None:
        done = [node.name for node in queryset if node_tokens.revoke_node_token(node.name)]
        if done:
            self.message_user(request, f"Token revoked: {', '.join(done)}.", messages.SUCCESS)
        else:
            self.message_user(request, "No token to revoke.", messages.INFO)

    # Issuing a certificate hands over a private key: `manage.py issue_node_cert` (to a file,
    # mode 0600) or the admin API (in its answer), not a page a browser may keep.
    @admin.action(description="Revoke the node certificate", permissions=["change"])
    def revoke_cert(self, request: HttpRequest, queryset: QuerySet[Node]) -> None:
        done = [node.name for node in queryset if node_certs.revoke_node_cert(node.name)]
        if done:
            self.message_user(request, f"Certificate revoked: {', '.join(done)}.", messages.SUCCESS)
        else:
            self.message_user(request, "No certificate to revoke.", messages.INFO)


# --------------------------------------------------------------------------- what runs


# Shards are placed by the reconciler and reported by agents: shown, never edited.
SHARD_COLUMNS: tuple[str, ...] = (
    "node",
    "rank",
    "gpu_indices",
    "port",
    "observed",
    "exit_code",
    "failure_class",
    "message",
    "requests_running",
    "requests_waiting",
    "cache_tokens",
    "updated_at",
)


class ShardInline(admin.TabularInline[Shard, Replica]):
    model = Shard
    extra = 0
    can_delete = False
    fields = SHARD_COLUMNS
    readonly_fields = SHARD_COLUMNS

    def has_add_permission(self, request: HttpRequest, obj: Replica | None = None) -> bool:
        return False


@admin.register(Replica)
class ReplicaAdmin(admin.ModelAdmin[Replica]):
    """Replicas are the reconciler's: created, moved and stopped by it. Operators look, and
    restart one when they must."""

    list_display = [
        "__str__",
        "profile",
        "desired",
        "observed",
        "failures",
        "failure_class",
        "ready_at",
    ]
    list_filter = ["desired", "observed", "failure_class", "model"]
    list_select_related = ["model", "profile"]
    inlines = [ShardInline]
    actions = ["restart"]

    def get_readonly_fields(self, request: HttpRequest, obj: Replica | None = None) -> list[str]:
        # The engine key is the gateway's and the agent's secret, never shown on a page.
        return [f.name for f in Replica._meta.concrete_fields if f.name != "engine_key"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        # Every field is read-only, so a Save button would only mislead.
        context = {**(extra_context or {}), "show_save": False, "show_save_and_continue": False}
        return super().change_view(request, object_id, form_url, context)

    @admin.action(description="Restart now (new generation)", permissions=["change"])
    def restart(self, request: HttpRequest, queryset: QuerySet[Replica]) -> None:
        done = [
            str(replica)
            for replica in queryset.select_related("model")
            if operations.restart_replica(replica.pk, actor=actor(request))
        ]
        if done:
            self.message_user(request, f"Restarting: {', '.join(done)}.", messages.SUCCESS)
        else:
            self.message_user(
                request, "Nothing restarted: only replicas wanted running restart.", messages.INFO
            )


# --------------------------------------------------------------------------- read-only records


class ReadOnlyAdmin(admin.ModelAdmin[_Record]):
    """Rows only the control plane writes."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: _Record | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: _Record | None = None) -> bool:
        return False


@admin.register(Lease)
class LeaseAdmin(ReadOnlyAdmin[Lease]):
    list_display = ["name", "owner", "epoch", "expires_at"]


@admin.register(Event)
class EventAdmin(ReadOnlyAdmin[Event]):
    list_display = ["created_at", "kind", "subject", "message", "epoch"]
    list_filter = ["kind"]
    search_fields = ["subject", "message"]
    date_hierarchy = "created_at"
