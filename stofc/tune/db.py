"""The tuning database: an embedded SQLite file shared by every ``stofc tune``.

Default location ``cache_dir()/tuning.sqlite`` (``--db PATH`` overrides).
Two tables, both keyed by everything that can make a result stale — kernel
family, problem shape, GPU name, driver, stofc version, compile options:

* ``records``: one row per key, the best config found and its time
  (``upsert_best`` keeps the faster of the stored and the new record).
* ``samples``: every measured (key, config) with its time or fault, so that a
  later run (or a second process) never measures the same candidate twice.

Concurrency: WAL journal, a busy timeout, and ``BEGIN IMMEDIATE`` for every
write, so two processes can tune at once. Only parameterised queries.

Content checks: every row carries a ``digest``, the sha256 of its key, config,
time and fault (:func:`row_digest`); reads check it, and a row that does not
match (edited, or damaged in a way SQLite's own checks let through) is
deleted, reported once (:func:`stofc.cachecheck.warn_once`) and measured again.

Schema versions: ``schema_version`` holds one integer. An older schema is
upgraded in place by :data:`_MIGRATIONS` (version 1 -> 2 adds the digests); a
newer one is refused with a clear error (never silently rewritten). A file that is not a database (or is
corrupt) is moved aside to ``<name>.corrupt-<time>`` with a warning and a
fresh database is created; an SQLite file of some other program is refused.
"""

from __future__ import annotations

import hashlib
import json
import random
import sqlite3
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from stofc.cachecheck import warn_once
from stofc.errors import StofcError
from stofc.paths import cache_dir
from stofc.version import __version__

SCHEMA_VERSION = 2
BUSY_TIMEOUT_S = 60.0

_SCHEMA_V1 = (
    """CREATE TABLE records (
        family TEXT NOT NULL, problem TEXT NOT NULL, gpu TEXT NOT NULL, driver TEXT NOT NULL,
        stofc_version TEXT NOT NULL, compile_options TEXT NOT NULL,
        config TEXT NOT NULL, time_ms REAL NOT NULL, created REAL NOT NULL,
        PRIMARY KEY (family, problem, gpu, driver, stofc_version, compile_options))""",
    """CREATE TABLE samples (
        family TEXT NOT NULL, problem TEXT NOT NULL, gpu TEXT NOT NULL, driver TEXT NOT NULL,
        stofc_version TEXT NOT NULL, compile_options TEXT NOT NULL, config TEXT NOT NULL,
        time_ms REAL, fault TEXT, created REAL NOT NULL,
        PRIMARY KEY (family, problem, gpu, driver, stofc_version, compile_options, config))""",
)

_KEY_COLUMNS = "family, problem, gpu, driver, stofc_version, compile_options"


def row_digest(key_params: tuple[str, ...], config: str, time_ms: float | None,
               fault: str | None = None) -> str:
    """The content hash of one row: everything it says."""
    text = json.dumps([*key_params, config, None if time_ms is None else repr(float(time_ms)),
                       fault], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _add_digests(conn: sqlite3.Connection) -> None:
    """Schema 1 -> 2: a ``digest`` column in both tables, filled for the rows there."""
    for table, value_columns in (("records", "config, time_ms, NULL"),
                                 ("samples", "config, time_ms, fault")):
        conn.execute(f"ALTER TABLE {table} ADD COLUMN digest TEXT")
        rows = conn.execute(f"SELECT rowid, {_KEY_COLUMNS}, {value_columns} FROM {table}")
        for row in rows.fetchall():
            conn.execute(f"UPDATE {table} SET digest = ? WHERE rowid = ?",
                         (row_digest(tuple(row[1:7]), row[7], row[8], row[9]), row[0]))


# version -> steps (SQL statements or functions of the connection) that upgrade a database
# of that version to version + 1.
_MIGRATIONS: dict[int, tuple[str | Callable[[sqlite3.Connection], None], ...]] = {
    1: (_add_digests,),
}


class TuningDatabaseError(StofcError):
    """The tuning database cannot be used (newer schema, foreign file, unwritable)."""


@dataclass(frozen=True)
class RecordKey:
    """Everything that can make a tuning result stale."""

    family: str
    problem: str          # JSON list of the shape key
    gpu: str
    driver: str
    compile_options: str  # JSON list
    stofc_version: str = __version__

    def as_params(self) -> tuple[str, ...]:
        return (self.family, self.problem, self.gpu, self.driver, self.stofc_version,
                self.compile_options)


@dataclass(frozen=True)
class TuningRecord:
    """The best config of one key: its time (ms), config JSON and when it was written."""

    key: RecordKey
    config: str
    time_ms: float
    created: float


@dataclass(frozen=True)
class Sample:
    """One measured candidate: time (ms) or fault."""

    config: str
    time_ms: float | None
    fault: str | None


def default_path() -> Path:
    """``cache_dir()/tuning.sqlite``."""
    return cache_dir() / "tuning.sqlite"


def _stderr_warning(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


_KEY_WHERE = ("family = ? AND problem = ? AND gpu = ? AND driver = ? AND stofc_version = ? "
              "AND compile_options = ?")


class TuningDatabase:
    """An open tuning database. Use :meth:`open`; close with :meth:`close` or ``with``."""

    def __init__(self, path: Path, conn: sqlite3.Connection) -> None:
        self.path = path
        self._conn = conn

    # ---- opening -----------------------------------------------------------------
    @classmethod
    def open(cls, path: Path | str | None = None, *,
             on_warning: Callable[[str], None] = _stderr_warning) -> TuningDatabase:
        """Open (creating or upgrading) the database at ``path`` (default :func:`default_path`).

        A corrupt file is moved aside (``on_warning`` is told where) and replaced
        by a fresh database. Raises :class:`TuningDatabaseError` for a newer
        schema, an SQLite file that is not a stofc tuning database, or a path
        that cannot be written.
        """
        target = Path(path) if path is not None else default_path()
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise TuningDatabaseError(f"cannot create {target.parent} ({err.strerror})",
                                      hint="choose another --db PATH") from None
        try:
            conn = cls._connect_checked(target)
        except sqlite3.DatabaseError as err:
            if isinstance(err, sqlite3.OperationalError) and not _looks_corrupt(err):
                raise TuningDatabaseError(f"cannot open tuning database {target} ({err})",
                                          hint="choose another --db PATH") from None
            aside = _move_aside(target)
            on_warning(f"tuning database {target} is corrupt ({err}); moved it to {aside} "
                       "and started a fresh one")
            conn = cls._connect_checked(target)
        return cls(target, conn)

    @staticmethod
    def _connect_checked(target: Path) -> sqlite3.Connection:
        conn = sqlite3.connect(str(target), timeout=BUSY_TIMEOUT_S, isolation_level=None)
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            result = conn.execute("PRAGMA quick_check").fetchone()
            if result is None or result[0] != "ok":
                raise sqlite3.DatabaseError(f"quick_check: {result[0] if result else 'no answer'}")
            _retry_locked(lambda: conn.execute("PRAGMA journal_mode = WAL"))
            conn.execute("PRAGMA synchronous = NORMAL")
            _retry_locked(lambda: _ensure_schema(conn, target))
        except BaseException:
            conn.close()
            raise
        return conn

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> TuningDatabase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (``BEGIN IMMEDIATE``: takes the write lock up front)."""
        _retry_locked(lambda: self._conn.execute("BEGIN IMMEDIATE"))
        try:
            yield self._conn
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    # ---- records -----------------------------------------------------------------
    def best(self, key: RecordKey) -> TuningRecord | None:
        """The stored best config for ``key``, or None."""
        row = self._conn.execute(
            f"SELECT config, time_ms, created, digest FROM records WHERE {_KEY_WHERE}",
            key.as_params()).fetchone()
        if row is None:
            return None
        if row[3] != row_digest(key.as_params(), row[0], row[1]):
            self._drop("records", key, None)
            return None
        return TuningRecord(key, row[0], row[1], row[2])

    def _drop(self, table: str, key: RecordKey, config: str | None) -> None:
        """Delete a row whose digest does not match (warned once); it is measured again."""
        warn_once("tuning", f"tuning database {self.path} has a {table} row that does not "
                            f"match its digest ({key.family} {key.problem}); deleted it")
        with self._write() as conn:
            if config is None:
                conn.execute(f"DELETE FROM {table} WHERE {_KEY_WHERE}", key.as_params())
            else:
                conn.execute(f"DELETE FROM {table} WHERE {_KEY_WHERE} AND config = ?",
                             (*key.as_params(), config))

    def upsert_best(self, key: RecordKey, config: str, time_ms: float) -> None:
        """Store ``config`` as the best for ``key`` unless a faster one is stored."""
        with self._write() as conn:
            conn.execute(
                "INSERT INTO records (family, problem, gpu, driver, stofc_version, "
                "compile_options, config, time_ms, created, digest) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (family, problem, gpu, driver, stofc_version, compile_options) "
                "DO UPDATE SET config = excluded.config, time_ms = excluded.time_ms, "
                "created = excluded.created, digest = excluded.digest "
                "WHERE excluded.time_ms < records.time_ms",
                (*key.as_params(), config, float(time_ms), time.time(),
                 row_digest(key.as_params(), config, float(time_ms))))

    # ---- samples -----------------------------------------------------------------
    def samples(self, key: RecordKey) -> dict[str, Sample]:
        """Every stored sample of ``key``, by config JSON."""
        rows = self._conn.execute(
            f"SELECT config, time_ms, fault, digest FROM samples WHERE {_KEY_WHERE}",
            key.as_params()).fetchall()
        out = {}
        for config, time_ms, fault, digest in rows:
            if digest != row_digest(key.as_params(), config, time_ms, fault):
                self._drop("samples", key, config)
                continue
            out[config] = Sample(config, time_ms, fault)
        return out

    def add_samples(self, key: RecordKey, samples: list[Sample]) -> None:
        """Store samples of ``key`` in one transaction (a sample already stored is kept)."""
        now = time.time()
        with self._write() as conn:
            conn.executemany(
                "INSERT OR IGNORE INTO samples (family, problem, gpu, driver, stofc_version, "
                "compile_options, config, time_ms, fault, created, digest) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [(*key.as_params(), s.config, s.time_ms, s.fault, now,
                  row_digest(key.as_params(), s.config, s.time_ms, s.fault)) for s in samples])

    def set_sample(self, key: RecordKey, sample: Sample) -> None:
        """Store ``sample``, replacing a stored one (a winner found wrong at verification)."""
        with self._write() as conn:
            conn.execute(
                "INSERT OR REPLACE INTO samples (family, problem, gpu, driver, stofc_version, "
                "compile_options, config, time_ms, fault, created, digest) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (*key.as_params(), sample.config, sample.time_ms, sample.fault, time.time(),
                 row_digest(key.as_params(), sample.config, sample.time_ms, sample.fault)))

    # ---- maintenance -------------------------------------------------------------
    def counts_by_gpu(self) -> dict[str, tuple[int, int]]:
        """GPU name → (records, samples)."""
        out: dict[str, list[int]] = {}
        for table, slot in (("records", 0), ("samples", 1)):
            for gpu, count in self._conn.execute(
                    f"SELECT gpu, COUNT(*) FROM {table} GROUP BY gpu ORDER BY gpu"):
                out.setdefault(gpu, [0, 0])[slot] = count
        return {gpu: (c[0], c[1]) for gpu, c in sorted(out.items())}

    def clear(self, gpu: str | None = None) -> int:
        """Delete records and samples (of one GPU name, or all); return rows deleted."""
        deleted = 0
        with self._write() as conn:
            for table in ("records", "samples"):
                if gpu is None:
                    cur = conn.execute(f"DELETE FROM {table}")
                else:
                    cur = conn.execute(f"DELETE FROM {table} WHERE gpu = ?", (gpu,))
                deleted += cur.rowcount
        return deleted

    def compact(self) -> bool:
        """Give freed pages back to the file system (VACUUM); False if another process is busy."""
        try:
            self._conn.execute("VACUUM")
        except sqlite3.OperationalError:
            return False
        return True


def _retry_locked(step: Callable[[], object], timeout_s: float = BUSY_TIMEOUT_S) -> None:
    """Run ``step``, retrying while another process holds the lock.

    SQLite's busy handler is not called when waiting could deadlock (two
    connections switching a fresh file to WAL at once); it reports
    "database is locked" at once instead. Retrying after a short, jittered
    sleep is then correct.
    """
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while True:
        try:
            step()
            return
        except sqlite3.OperationalError as err:
            text = str(err).lower()
            if ("locked" not in text and "busy" not in text) or time.monotonic() > deadline:
                raise
        time.sleep(delay * (1 + random.random()))
        delay = min(delay * 2, 0.2)


def _looks_corrupt(err: sqlite3.Error) -> bool:
    text = str(err).lower()
    return any(w in text for w in ("not a database", "malformed", "corrupt", "quick_check"))


def _move_aside(target: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = target.with_name(f"{target.name}.corrupt-{stamp}")
    n = 1
    while aside.exists():
        aside = target.with_name(f"{target.name}.corrupt-{stamp}-{n}")
        n += 1
    target.replace(aside)
    for suffix in ("-wal", "-shm"):
        side = target.with_name(target.name + suffix)
        if side.exists():
            side.replace(aside.with_name(aside.name + suffix))
    return aside


def _ensure_schema(conn: sqlite3.Connection, target: Path) -> None:
    """Create, upgrade or refuse the schema, in one write transaction."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        tables = {row[0] for row in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not tables:  # a fresh file: version 1, then the same upgrades as an old file
            for statement in (*_SCHEMA_V1, "CREATE TABLE schema_version (version INTEGER NOT NULL)"):
                conn.execute(statement)
            conn.execute("INSERT INTO schema_version (version) VALUES (1)")
            tables = {"schema_version"}
        if "schema_version" not in tables:
            raise TuningDatabaseError(
                f"{target} is an SQLite file but not a stofc tuning database "
                f"(tables: {', '.join(sorted(tables))})",
                hint="pass --db with another path; stofc will not overwrite it")
        else:
            row = conn.execute("SELECT version FROM schema_version").fetchone()
            version = int(row[0]) if row else 0
            if version > SCHEMA_VERSION:
                raise TuningDatabaseError(
                    f"tuning database {target} has schema version {version}, newer than this "
                    f"stofc {__version__} understands ({SCHEMA_VERSION})",
                    hint="upgrade stofc, or pass --db with another path")
            while version < SCHEMA_VERSION:
                steps = _MIGRATIONS.get(version)
                if steps is None:
                    raise TuningDatabaseError(
                        f"tuning database {target} has schema version {version}, which cannot "
                        "be upgraded", hint=f"move {target.name} away or pass --db with another path")
                for step in steps:
                    if callable(step):
                        step(conn)
                    else:
                        conn.execute(step)
                version += 1
                conn.execute("UPDATE schema_version SET version = ?", (version,))
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
