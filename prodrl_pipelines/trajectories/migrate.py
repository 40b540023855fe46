"""Converting a store written in the earlier layout (one Parquet part per write) into the tables.

The earlier layout, under the same blob store::

    trajectories/policy_version=<v>/part-<uuid7>.parquet   calls (policy_version in the key)
    rewards/part-<uuid7>.parquet                            rewards
    retracted/part-<uuid7>.parquet                          retractions
    quarantine/round=<round>/part-<uuid7>.parquet           quarantine
    ledger/round=<round>.parquet                            a round's ledger

``migrate`` appends each kind's parts to its table in one commit, in write order (the part's
time-ordered name becomes the rows' ``_part``), tagged with the application transaction
``prodrl-migrate``: running it again finds the commit and writes nothing. Each table's migrated row
count is checked against the parts' rows before it reports; the old parts are left where they are
(``delete_legacy`` removes them once the counts match).
"""

from __future__ import annotations

from urllib.parse import unquote

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from prodrl_pipelines.trajectories.rows import conform
from prodrl_pipelines.trajectories.schema import CALL_SCHEMA, QUARANTINE_SCHEMA, REWARD_SCHEMA
from prodrl_pipelines.trajectories.store import (
    CALLS, LEDGER, LEDGER_SCHEMA, PARTITION_BY, QUARANTINE, RETRACTION_SCHEMA, RETRACTIONS, REWARDS, STORED,
    TrajectoryStore,
)

MIGRATION_APP_ID = "prodrl-migrate"
LEGACY_PREFIXES = {CALLS: "trajectories/", REWARDS: "rewards/", RETRACTIONS: "retracted/",
                   QUARANTINE: "quarantine/", LEDGER: "ledger/"}
_CONTRACT = {CALLS: CALL_SCHEMA, REWARDS: REWARD_SCHEMA, RETRACTIONS: RETRACTION_SCHEMA,
             QUARANTINE: QUARANTINE_SCHEMA, LEDGER: LEDGER_SCHEMA}


class MigrationError(RuntimeError):
    """A legacy part cannot be migrated or a count does not match; the message names the part or table."""


def legacy_parts(store: TrajectoryStore) -> dict[str, list[str]]:
    """Keys of the earlier layout's parts, per table, in write order."""
    out = {}
    for name, prefix in LEGACY_PREFIXES.items():
        keys = [k for k in store.blobs.list(prefix) if k.endswith(".parquet")]
        out[name] = sorted(keys, key=lambda k: k.rsplit("/", 1)[-1])
    return out


def _segment_value(key: str, column: str) -> str:
    for seg in key.split("/"):
        if seg.startswith(column + "="):
            value = seg[len(column) + 1:]
            return unquote(value[: -len(".parquet")] if value.endswith(".parquet") else value)
    raise MigrationError(f"legacy part {key!r} has no {column}=... segment")


def _read_part(store: TrajectoryStore, name: str, key: str) -> pa.Table:
    try:
        t = pq.read_table(pa.BufferReader(store.blobs.get_bytes(key)))
    except Exception as e:  # a torn or foreign file: name it, migrate nothing
        raise MigrationError(f"legacy part {key!r} cannot be read: {e}") from None
    contract = _CONTRACT[name]
    if name == CALLS:
        t = t.drop_columns([c for c in ("policy_version",) if c in t.column_names])
        t = t.append_column("policy_version", pa.array([_segment_value(key, "policy_version")] * t.num_rows,
                                                       pa.string()))
    t = conform(t, contract)
    if name in (QUARANTINE, LEDGER):
        t = t.add_column(0, "round", pa.array([_segment_value(key, "round")] * t.num_rows, pa.string()))
    if name != LEDGER:
        part = key.rsplit("/", 1)[-1].removeprefix("part-").removesuffix(".parquet")
        t = t.append_column("_part", pa.array([part] * t.num_rows, pa.string()))
        t = t.append_column("_row", pa.array(range(t.num_rows), pa.int32()))
    return t.select(STORED[name].names).cast(STORED[name])


def migrate(store: TrajectoryStore, *, delete_legacy: bool = False) -> dict:
    """Migrate every kind (see the module docstring); per table: legacy parts and rows, rows
    migrated now, and whether the table already held this migration."""
    report = {}
    parts = legacy_parts(store)
    for name, keys in parts.items():
        if not keys:
            continue
        tables = [_read_part(store, name, k) for k in keys]
        rows = sum(t.num_rows for t in tables)
        done = (store.tables.txn_version(name, MIGRATION_APP_ID) or 0) >= 1
        if not done:
            store.tables.append(name, pa.concat_tables(tables), PARTITION_BY.get(name, ()), txn=(MIGRATION_APP_ID, 1))
        found = _count_migrated(store, name, tables)
        if found != rows and not done:  # (after the commit, a round may have re-materialised its ledger)
            raise MigrationError(f"table {name}: {rows} rows in {len(keys)} legacy parts but {found} found in the "
                                 f"table after migrating: the legacy parts are kept")
        report[name] = {"legacy_parts": len(keys), "rows": rows, "migrated_now": 0 if done else rows,
                        "already_migrated": done}
        if delete_legacy:
            for k in keys:
                store.blobs.delete(k, missing_ok=True)
            report[name]["legacy_deleted"] = len(keys)
    return report


def _count_migrated(store: TrajectoryStore, name: str, tables: list[pa.Table]) -> int:
    if name == LEDGER:
        rounds = sorted({r for t in tables for r in t.column("round").to_pylist()})
        return store.tables.scan(name, STORED[name], filter=ds.field("round").isin(rounds), columns=["round"]).num_rows
    part_ids = pa.array(sorted({p for t in tables for p in t.column("_part").to_pylist()}), pa.string())
    got = store.tables.scan(name, STORED[name], columns=["_part"])
    return int(pc.sum(pc.is_in(got.column("_part"), value_set=part_ids)).as_py() or 0)
