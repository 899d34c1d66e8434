"""What llmgw tells its operators about itself: the Prometheus metrics both apps count through
(``metrics``), and OpenTelemetry traces (``tracing``; ``otel``, imported only when tracing is on).

The ground floor: it imports nothing of ours (a contract in ``pyproject.toml`` says so), so
counting a request or a reconcile tick pulls in nothing else.
"""
