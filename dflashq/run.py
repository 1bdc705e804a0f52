"""A run as every part sees it: settings, Redis connection, results store, key names, and the joined manifest."""

from __future__ import annotations

import dataclasses

import redis

from dflashq import manifest
from dflashq.connection import connect
from dflashq.keys import Keys
from dflashq.layer_ids import resolve_layer_ids
from dflashq.settings import Settings
from dflashq.store import Store


@dataclasses.dataclass
class Run:
    settings: Settings
    conn: redis.Redis
    store: Store
    keys: Keys
    manifest: dict

    @property
    def layer_ids(self) -> list[int]:
        return list(self.manifest["layer_ids"])

    @classmethod
    def open(cls, settings: Settings, data_fingerprint: str | None = None, join: bool = True, with_layers: bool = True,
             heal=None) -> "Run":
        """Connect and join the run; `join=False` only reads (status, dashboards) and never writes the manifest.

        `with_layers=False` is for the producer, which needs only the target's tokenizer, not its config.
        `heal` is called while Redis is unreachable (ops passes the embedded server's restart)."""
        conn = connect(settings.redis.url, outage_seconds=settings.redis.outage_seconds, heal=heal)
        store = Store(settings.store.path, settings.run)
        keys = Keys(settings.run)
        if not join:
            return cls(settings, conn, store, keys, manifest.read(conn, settings.run))
        layer_ids = resolve_layer_ids(settings.model.path, settings.model.layer_ids, settings.train.num_layers) if settings.model.path and with_layers else None
        joined = manifest.join(conn, store, manifest.expected(settings, layer_ids, data_fingerprint))
        return cls(settings, conn, store, keys, joined)
