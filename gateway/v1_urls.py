"""The URLconf of ``/v1``'s own Django handler (``gateway.asgi``): only the ninja API. A web
process that serves only ``/v1`` then never imports the site's URLconf (the admin, the account
pages, single sign-on, the admin API): about 0.3 s of CPU at start on a slow machine
(measured), spent instead by the first request for one of those pages."""

import gc

from django.urls import path

from gateway.api import api

urlpatterns = [path("v1/", api.urls)]

# Loaded on the first /v1 request that is not a relay route or the model list, after the process
# froze what it had loaded at start (gateway.upstreams): ninja's objects are kept out of the
# cyclic collector's full scans too.
gc.freeze()
