"""Routing: which upstream serves a request.

The routing table built from the catalog, the ready replicas and the static endpoints
(``table``: pure) as the store has them (``loading``), and the live table of this web process
with its outstanding counts, ejections and the stamps the control plane reads (``upstreams``).
Routing by the cache: a prompt as an engine's prefix cache sees it, cut into blocks
(``prefix``), what this process expects each upstream's cache to hold (``mirrors``), how much of
the recent traffic each prefix is (``shares``), what the web processes of one host tell each
other of their placements and loads (``peers``), and the choice itself, where the prefix is
cached bounded by load (``choice``: pure).
"""
