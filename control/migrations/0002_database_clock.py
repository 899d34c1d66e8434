"""The database clock function ``llmgw_clock_ms()`` on PostgreSQL (see ``control.dbclock``).

SQLite gets the same function registered on each connection instead, so nothing happens there.
"""

from typing import Any

from django.db import migrations

from control.dbclock import POSTGRES_CREATE, POSTGRES_DROP


def create_clock(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(POSTGRES_CREATE)


def drop_clock(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(POSTGRES_DROP)


class Migration(migrations.Migration):
    dependencies = [("control", "0001_initial")]
    operations = [migrations.RunPython(create_clock, drop_clock, elidable=False)]
