"""``make bench-routing``: how long users wait on a fleet of engines with prefix caches, through
llmgw and through SGLang's Model Gateway, side by side. Run with ``python -m bench.routing``."""
