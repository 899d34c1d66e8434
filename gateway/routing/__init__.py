"""Routing: which upstream serves a request.

The routing table built from the catalog, the ready replicas and the static endpoints
(``table``: pure) as the store has them (``loading``), and the live table of this web process
with its ejections and the stamps the control plane reads (``upstreams``). Routing by the cache
(``placing``: one process's state and the choice it makes from it): a prompt as an engine's
prefix cache sees it, cut into blocks (``prefix``), what this process expects each upstream's
cache to hold (``mirrors``), the requests in flight at each upstream and the prefill queued
there, and which prefixes are hot (``loads``), the board on which the web processes of one host
share those loads and new prefixes' homes through memory (``board``), what they tell each
other of their placements (``peers``), and the choice itself, where the prefix is cached
bounded by load (``choice``: pure).
"""
