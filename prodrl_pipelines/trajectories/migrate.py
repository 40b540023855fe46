"""Converting a store written in the earlier layout (one Parquet part per write) into the tables.

The earlier layout, under the same blob store::

    trajectories/policy_version=<v>/part-<uuid7>.parquet   calls (policy_version in the key)
    rewards/part-<uuid7>.parquet                            rewards
    retracted/part-<uuid7>.parquet                          retractions
    quarantine/round=<round>/part-<uuid7>.parquet           quarantine
    ledger/round=<round>.parquet                            a round's ledger

``migrate`` appends each kind's parts to its table in write order (the part's time-ordered name
becomes the rows' ``_part``; a ledger part's round its ``round``), streaming them: parts are read one
at a time and committed in batches of at most ``batch_rows`` rows (a larger part alone), each commit
tagged with the application transaction ``prodrl-migrate``. What is migrated is read back from the
table itself (the ``_part`` ids, the ledger's rounds), not from a flag: a part an old writer adds
after a completed migration is migrated by the next run, a run stopped half-way resumes where its
last commit landed, and nothing is written twice. Each batch's rows are checked against its parts
after the commit. The old parts are left where they are unless ``delete_legacy``: then, once every
part of a table is in it with its row count, exactly those parts are removed (a part written while
the run goes on is not among them).
"""

from __future__ import annotations

from urllib.parse import unquote

import pyarrow as pa
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


DEFAULT_BATCH_ROWS = 200_000  # rows held in memory per migration commit
_LOOKUP = 1000  # parts whose presence in the table is asked in one scan


def _part_id(name: str, key: str) -> str:
    """What a part's rows carry in the table: the ledger's round, else the part's ``_part`` id."""
    if name == LEDGER:
        return _segment_value(key, "round")
    return key.rsplit("/", 1)[-1].removeprefix("part-").removesuffix(".parquet")


def _in_table(store: TrajectoryStore, name: str, ids: list[str]) -> dict[str, int]:
    """Rows of the table per part id (the ledger: per round) among ``ids``; absent ids are left out."""
    column = "round" if name == LEDGER else "_part"
    got = store.tables.scan(name, STORED[name], filter=ds.field(column).isin(ids), columns=[column])
    if got.num_rows == 0:
        return {}
    counts = got.group_by(column).aggregate([(column, "count")])
    return dict(zip(counts.column(column).to_pylist(), counts.column(f"{column}_count").to_pylist()))


def migrate(store: TrajectoryStore, *, delete_legacy: bool = False, batch_rows: int = DEFAULT_BATCH_ROWS) -> dict:
    """Migrate every kind (see the module docstring); per table: legacy parts and their rows, rows
    migrated now, whether every part was already in the table, and with ``delete_legacy`` the parts
    deleted."""
    report = {}
    for name, keys in legacy_parts(store).items():
        if keys:
            report[name] = _migrate_table(store, name, keys, delete_legacy, max(int(batch_rows), 1))
    return report


def _migrate_table(store: TrajectoryStore, name: str, keys: list[str], delete_legacy: bool, batch_rows: int) -> dict:
    rows = migrated_now = 0
    batch: list[tuple[str, pa.Table]] = []

    def commit() -> None:
        nonlocal migrated_now
        if not batch:
            return
        tag = (store.tables.txn_version(name, MIGRATION_APP_ID) or 0) + 1
        store.tables.append(name, pa.concat_tables([t for _, t in batch]), PARTITION_BY.get(name, ()),
                            txn=(MIGRATION_APP_ID, tag))
        found = _in_table(store, name, [_part_id(name, k) for k, _ in batch])
        for key, t in batch:
            if found.get(_part_id(name, key), 0) != t.num_rows:
                raise MigrationError(f"table {name}: legacy part {key!r} has {t.num_rows} rows but "
                                     f"{found.get(_part_id(name, key), 0)} are in the table after migrating it: "
                                     "the legacy parts are kept")
        migrated_now += sum(t.num_rows for _, t in batch)
        batch.clear()

    for i in range(0, len(keys), _LOOKUP):
        chunk = keys[i:i + _LOOKUP]
        present = _in_table(store, name, [_part_id(name, k) for k in chunk])
        for key in chunk:
            t = _read_part(store, name, key)
            rows += t.num_rows
            n = present.get(_part_id(name, key))
            # a ledger round may have been re-materialised since: its rows in the table are the truth
            if n is not None and (n == t.num_rows or name == LEDGER):
                continue
            if n is not None:
                raise MigrationError(f"table {name}: legacy part {key!r} has {t.num_rows} rows but {n} with its "
                                     "id are in the table: the legacy parts are kept")
            if batch and sum(b.num_rows for _, b in batch) + t.num_rows > batch_rows:
                commit()
            batch.append((key, t))
        commit()
    out = {"legacy_parts": len(keys), "rows": rows, "migrated_now": migrated_now, "already_migrated": migrated_now == 0}
    if delete_legacy:  # every listed part is in the table with its rows (checked above): those, and only those
        for k in keys:
            store.blobs.delete(k, missing_ok=True)
        out["legacy_deleted"] = len(keys)
    return out
