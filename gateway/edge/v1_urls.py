"""The URLconf of ``/v1``'s own Django handler (``gateway.edge.asgi``): only the ninja API. A web
process that serves only ``/v1`` then never imports the site's URLconf (the admin, the account
pages, single sign-on, the admin API): about 0.3 s of CPU at start on a slow machine
(measured), spent instead by the first request for one of those pages."""

from django.urls import path

from gateway.edge.api import api

urlpatterns = [path("v1/", api.urls)]
