"""The edge: where a client's bytes enter the gateway.

The ASGI front door of ``/v1`` (``asgi``: reads and bounds the body, authenticates the key,
hands the request to the relay and writes its answer), the ninja API that documents and serves
the rest of ``/v1`` (``api``, ``schemas``, ``v1_urls``) and daphne's body limit for ``runserver``
(``daphne_guard``). Nothing here decides where a request goes or what it costs.
"""
