"""The relay: one request from an authenticated client to an engine and back.

An exchange (one request's state up to its usage row), its attempts at upstreams and the
retries before the first byte, waiting for a model that is starting, the rules for what is read
from and changed in bodies (``payload``), tokens counted when an engine reports none
(``counting``), the engine client (``upstream_client``) and a graceful stop (``drain``).
"""
