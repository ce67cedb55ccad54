"""Alembic environment: SQLite in batch mode (it has almost no ALTER TABLE)."""
from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, event, pool

from lora_worker.ledger.migrate import allow_batch_rename
from lora_worker.ledger.models import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_offline() -> None:
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata,
                      literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = create_engine(config.get_main_option("sqlalchemy.url"), poolclass=pool.NullPool)
    event.listen(engine, "connect", allow_batch_rename)
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
