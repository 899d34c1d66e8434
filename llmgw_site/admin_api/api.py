"""``/api/admin/v1/``: the operators' API (django-ninja), with its own OpenAPI document at
``/api/admin/v1/openapi.json`` (interactive docs at ``/api/admin/v1/docs``).

This module assembles it: one ``NinjaAPI`` with the admin's authentication, every route in one
transaction, the one error shape (``llmgw_site.admin_api.errors``) and the routers of
``llmgw_site.admin_api.resources``, one per resource. An edge: each route parses its input,
calls the one domain function for the change (the same the admin's actions and the
``manage.py`` commands call: ``control.operations``, ``control.node_tokens``,
``gateway.identity.keys``, ``gateway.identity.people``, ``llmgw_site.catalog``) and formats
the result. Errors are ``{"error": {"code", "message", "field"}}``; every list is paginated
with ``limit`` and ``offset`` and answers ``{"items", "count"}``
(``llmgw_site.admin_api.pagination``).

Routes are synchronous: this is an operator's API, not the request path, and the ORM calls
would need a thread each anyway.
"""

import functools
from collections.abc import Callable
from typing import Any

from django.db import DataError, transaction
from ninja import NinjaAPI

from llmgw_site.admin_api import errors
from llmgw_site.admin_api.auth import AdminAuth
from llmgw_site.admin_api.errors import ERRORS, AdminApiError, ErrorOut
from llmgw_site.admin_api.resources import catalog, fleet, keys, people, usage


class AdminNinjaAPI(NinjaAPI):
    """Its OpenAPI document names operations as generated clients call them and gives every
    operation the one error shape."""

    def get_openapi_operation_id(self, operation: Any) -> str:
        # "drain_node", not "llmgw_site_admin_api_resources_fleet_drain_node": what generated
        # clients call.
        return str(operation.view_func.__name__)

    def get_openapi_schema(self, *args: Any, **kwargs: Any) -> Any:
        schema = super().get_openapi_schema(*args, **kwargs)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        body = ErrorOut.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        components["ErrorOut"] = body
        content = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorOut"}}}
        for path in schema["paths"].values():
            for operation in path.values():
                responses = operation.setdefault("responses", {})
                for status, description in ERRORS.items():
                    responses.setdefault(status, {"description": description, "content": content})
                if operation.get("operationId") == "put_catalog":
                    responses.setdefault(
                        "400", {"description": "not a JSON or YAML document", "content": content}
                    )
        return schema


api = AdminNinjaAPI(
    title="llmgw admin API",
    version="1",
    description="Operate llmgw from programs: the catalog, nodes, replicas, users, teams, "
    "API keys, usage, events and the lease. Authenticate with an admin token "
    "(Authorization: Bearer llmgw-admin-…) or a staff session with its CSRF token.",
    urls_namespace="admin_api",
    auth=AdminAuth(),
)


def one_transaction(view: Callable[..., Any]) -> Callable[..., Any]:
    """Each route in one transaction: a change is all or nothing, and a value the store
    refuses (a NUL character, a time zone PostgreSQL does not know, a number past its
    integers) is the caller's 422, not a half-done request or a 500."""

    @functools.wraps(view)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with transaction.atomic():
                return view(*args, **kwargs)
        except (DataError, OverflowError) as exc:
            raise AdminApiError(
                422,
                code="invalid",
                message=f"a value the store cannot hold: {str(exc).splitlines()[0]}",
            ) from None

    return wrapper


api.add_decorator(one_transaction)
errors.install(api)

# In this order, the order of the OpenAPI document's paths; keys stand with people.
api.add_router("/", catalog.router)
api.add_router("/", fleet.router)
api.add_router("/", people.router)
api.add_router("/", keys.router)
api.add_router("/", usage.router)
