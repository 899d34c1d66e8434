"""The ledger: what was used, recorded once.

Usage rows written off the request path through a local journal (``usage``), hourly rollups and
raw-row retention (``rollups``), reports and CSV over both (``reports``) and the dashboard's
recent traffic (``traffic``).
"""
