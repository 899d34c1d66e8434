"""The URLconf of ``/v1``'s own Django handler (``gateway.edge.asgi``): only the ninja API. A web
process that serves only ``/v1`` then never imports the site's URLconf (the admin, the account
pages, single sign-on, the admin API) at start; the first request for one of those pages pays
for them instead (docs/decisions.md, '/v1's own URLconf')."""

from django.urls import path

from gateway.edge.api import api

urlpatterns = [path("v1/", api.urls)]
