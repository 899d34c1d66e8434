"""``make bench``: what llmgw adds over calling the engine directly, and the control
plane's cold start and failover. Run with ``python -m bench``."""
