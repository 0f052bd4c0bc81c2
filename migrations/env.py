"""Alembic environment for kvcanary.

The database URL comes from the Alembic config (``sqlalchemy.url``, set by
:func:`monitor.storage.db.upgrade`) or else from ``KVCANARY_DATABASE_URL``. Engines are built by
:func:`monitor.storage.db.make_engine`, so migrations see the same SQLite pragmas (foreign keys)
as the service. SQLite runs in batch mode: its ALTER TABLE cannot change or drop columns, so Alembic
copies the table instead.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from alembic import context

# `alembic` run from a checkout: make the repository importable without installing it. (Installed
# from the wheel, the folder above is the `kvcanary` package itself, which must stay off sys.path.)
_REPO = Path(__file__).resolve().parent.parent
if (_REPO / "pyproject.toml").is_file() and str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from kvcanary.monitor.storage import models  # noqa: E402  (registers the tables on Base.metadata)
from kvcanary.monitor.storage.db import make_engine  # noqa: E402

config = context.config
target_metadata = models.Base.metadata


def _url() -> str:
    # No alembic.ini: the CLI reads [tool.alembic] from pyproject.toml, which holds no URL.
    section = config.get_section(config.config_ini_section, {})
    url = section.get("sqlalchemy.url") or os.environ.get("KVCANARY_DATABASE_URL")
    if not url:
        raise RuntimeError("no database URL: set sqlalchemy.url or KVCANARY_DATABASE_URL")
    return url


def run_migrations_offline() -> None:
    """Emit the SQL to stdout instead of running it (``alembic upgrade head --sql``)."""
    url = _url()
    context.configure(
        url=url,
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        render_as_batch=url.startswith("sqlite"),
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = make_engine(_url())
    try:
        with engine.connect() as connection:
            context.configure(
                connection=connection,
                target_metadata=target_metadata,
                render_as_batch=connection.dialect.name == "sqlite",
            )
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
