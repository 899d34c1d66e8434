"""Live diagnostics of every llmgw process on this host: each answers for itself on a private
channel (``telemetry.diagnostics``); ``process`` starts that channel in a web process, the
worker and beat; ``views`` is the admin's diagnostics page and its data, which gather every
process's answers (on the admin listener only: ``llmgw_site.listeners``); ``manage.py
diagnose`` prints the same from a shell."""
