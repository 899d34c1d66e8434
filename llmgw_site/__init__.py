"""The llmgw Django project: settings, URLs, the ASGI application and the Celery app.

The Celery app (``llmgw_site.celery``) is not imported here, as Django projects usually do:
``celery -A llmgw_site`` finds it by that module's name, and a web process imports it only when
it first asks for an early reconcile tick. Importing it is a large part of a web process's
start, paid again by every web process a rolling restart starts (docs/decisions.md, 'Celery,
ninja and pydantic imported on first use').
"""
