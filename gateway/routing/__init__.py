"""Routing: which upstream serves a request.

The routing table built from the catalog, the ready replicas and the static endpoints
(``table``: pure), and the live table of this web process with its outstanding counts,
ejections and the stamps the control plane reads (``upstreams``).
"""
