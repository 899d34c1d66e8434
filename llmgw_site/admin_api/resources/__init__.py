"""The admin API's routes, one module per resource: the catalog (profiles, models, the
catalog document), the fleet (nodes, replicas, the lease, events), people (users, teams and
their limits), API keys, and usage. Each is a ninja ``Router`` that ``llmgw_site.admin_api.api``
mounts; each route parses its input, calls the one domain function for the change and formats
the result.
"""
