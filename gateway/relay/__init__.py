"""The relay: one request from an authenticated client to an engine and back.

The ``/v1`` paths that go to an engine, declared once (``routes``), its entry points
(``entry``), an exchange (one request's state up to its usage row: ``exchange``), its attempts
at upstreams and the retries before the first byte (``attempts``), waiting for a model that is
starting (``activation``), relaying the answer (``answers``), the rules for what is read from
and changed in bodies (``payload``), tokens counted when an engine reports none (``counting``),
the engine client (``upstream_client``) and a graceful stop (``drain``).
"""
