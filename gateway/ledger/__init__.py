"""The ledger: what was used, recorded once.

Usage rows, their journal's format and its sweep (``usage``), this process's pipeline that
journals and writes them off the request path (``recorder``), hourly rollups and
raw-row retention (``rollups``), reports and CSV over both (``reports``) and the dashboard's
recent traffic (``traffic``).
"""
