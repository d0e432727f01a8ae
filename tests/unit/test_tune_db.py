"""The tuning database: schema, versions, concurrency of two processes, corrupt files."""

from __future__ import annotations

import multiprocessing
import sqlite3

import pytest

from stofc.tune.db import (
    SCHEMA_VERSION,
    RecordKey,
    Sample,
    TuningDatabase,
    TuningDatabaseError,
    default_path,
)


def key(family: str = "gemm", gpu: str = "NVIDIA H200", problem: str = "[2048,768]") -> RecordKey:
    return RecordKey(family=family, problem=problem, gpu=gpu, driver="580.65",
                     compile_options='["-arch=sm_90"]')


def test_default_path_is_under_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("STOFC_CACHE_DIR", str(tmp_path / "c"))
    assert default_path() == tmp_path / "c" / "tuning.sqlite"
    with TuningDatabase.open() as db:
        assert db.path.is_file()


def test_best_keeps_the_fastest_and_keys_separate(tmp_path):
    with TuningDatabase.open(tmp_path / "t.sqlite") as db:
        assert db.best(key()) is None
        db.upsert_best(key(), '{"b":1}', 2.0)
        db.upsert_best(key(), '{"b":2}', 3.0)        # slower: ignored
        assert db.best(key()).config == '{"b":1}'
        db.upsert_best(key(), '{"b":3}', 1.5)        # faster: replaces
        record = db.best(key())
        assert (record.config, record.time_ms) == ('{"b":3}', 1.5)
        assert db.best(key(gpu="NVIDIA H100 80GB HBM3")) is None
        other = RecordKey("gemm", "[2048,768]", "NVIDIA H200", "580.65", '["-arch=sm_90"]',
                          stofc_version="0.0.1")
        assert db.best(other) is None                  # another stofc version is stale
        db.add_samples(key(), [Sample('{"b":1}', 2.0, None), Sample('{"b":9}', None, "timeout")])
        db.add_samples(key(), [Sample('{"b":1}', 7.0, None)])   # already stored: kept
        samples = db.samples(key())
        assert samples['{"b":1}'].time_ms == 2.0 and samples['{"b":9}'].fault == "timeout"
        assert db.counts_by_gpu() == {"NVIDIA H200": (1, 2)}


def test_values_are_parameters_not_sql(tmp_path):
    nasty = "x'); DROP TABLE records; --"
    with TuningDatabase.open(tmp_path / "t.sqlite") as db:
        db.upsert_best(key(family=nasty), '{"b":1}', 1.0)
        assert db.best(key(family=nasty)).time_ms == 1.0
        assert db.counts_by_gpu()["NVIDIA H200"] == (1, 0)


def test_an_unopenable_path_is_a_clear_error_not_a_move(tmp_path):
    folder = tmp_path / "a_directory"
    folder.mkdir()
    with pytest.raises(TuningDatabaseError, match="cannot open tuning database") as err:
        TuningDatabase.open(folder)
    assert "\n" not in str(err.value) and folder.is_dir()
    assert not list(tmp_path.glob("*.corrupt-*"))


def test_schema_version_newer_is_refused(tmp_path):
    path = tmp_path / "t.sqlite"
    TuningDatabase.open(path).close()
    conn = sqlite3.connect(path)
    conn.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    conn.commit()
    conn.close()
    with pytest.raises(TuningDatabaseError,
                       match=rf"schema version {SCHEMA_VERSION + 1}, newer than this stofc") as err:
        TuningDatabase.open(path)
    assert "\n" not in str(err.value)


def test_an_older_schema_is_upgraded_in_place(tmp_path, monkeypatch):
    import stofc.tune.db as dbmod

    old = tmp_path / "old.sqlite"
    with TuningDatabase.open(old) as db:
        db.upsert_best(key(), '{"b":1}', 2.0)
    now = SCHEMA_VERSION
    monkeypatch.setattr(dbmod, "SCHEMA_VERSION", now + 1)
    monkeypatch.setattr(dbmod, "_MIGRATIONS", {**dbmod._MIGRATIONS,
                                               now: ("ALTER TABLE records ADD COLUMN note TEXT",)})
    for path in (old, tmp_path / "fresh.sqlite"):
        with TuningDatabase.open(path) as db:
            assert db._conn.execute("SELECT version FROM schema_version").fetchone() == (now + 1,)
            columns = [r[1] for r in db._conn.execute("PRAGMA table_info(records)")]
            assert "note" in columns
    with TuningDatabase.open(old) as db:
        assert db.best(key()).time_ms == 2.0
    monkeypatch.setattr(dbmod, "SCHEMA_VERSION", now + 2)
    with pytest.raises(TuningDatabaseError,
                       match=f"schema version {now + 1}, which cannot be upgraded"):
        TuningDatabase.open(old)


def test_a_foreign_sqlite_file_is_refused_not_overwritten(tmp_path):
    path = tmp_path / "mine.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE photos (id INTEGER)")
    conn.commit()
    conn.close()
    with pytest.raises(TuningDatabaseError, match="not a stofc tuning database"):
        TuningDatabase.open(path)
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT name FROM sqlite_master").fetchall() == [("photos",)]
    conn.close()


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_corrupt_file_is_moved_aside_with_a_warning(tmp_path, damage):
    path = tmp_path / "t.sqlite"
    if damage == "garbage":
        path.write_bytes(b"this is not a database at all" * 200)
    else:
        with TuningDatabase.open(path) as db:
            for i in range(300):
                db.upsert_best(key(problem=f"[{i}]"), '{"b":1}', 1.0)
        data = path.read_bytes()
        path.write_bytes(data[:100] + b"\xff" * 3000 + data[3100:])
        for side in ("-wal", "-shm"):
            (tmp_path / f"t.sqlite{side}").unlink(missing_ok=True)
    warnings: list[str] = []
    with TuningDatabase.open(path, on_warning=warnings.append) as db:
        assert db.counts_by_gpu() == {}
        db.upsert_best(key(), '{"b":1}', 1.0)
    assert len(warnings) == 1 and "is corrupt" in warnings[0] and "started a fresh one" in warnings[0]
    aside = list(tmp_path.glob("t.sqlite.corrupt-*"))
    assert len(aside) == 1 and str(aside[0]) in warnings[0]


def _writer(path: str, gpu: str, count: int, barrier) -> None:
    barrier.wait()
    with TuningDatabase.open(path) as db:
        for i in range(count):
            db.upsert_best(key(gpu=gpu, problem=f"[{i}]"), f'{{"i":{i}}}', float(i + 1))
            db.add_samples(key(gpu=gpu, problem=f"[{i}]"), [Sample(f'{{"i":{i}}}', 1.0, None)])
            # Both processes also fight over one shared key: the fastest must win.
            db.upsert_best(key(gpu="shared"), f'{{"from":"{gpu}","i":{i}}}', 1000.0 - i)


def test_two_processes_write_at_once(tmp_path):
    path = str(tmp_path / "t.sqlite")
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_writer, args=(path, gpu, 150, barrier)) for gpu in ("A", "B")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    with TuningDatabase.open(path) as db:
        assert db.counts_by_gpu() == {"A": (150, 150), "B": (150, 150), "shared": (1, 0)}
        assert db.best(key(gpu="shared")).time_ms == 1000.0 - 149
        assert db.clear(gpu="A") == 300
        assert db.counts_by_gpu() == {"B": (150, 150), "shared": (1, 0)}


def test_a_row_that_does_not_match_its_digest_is_dropped_and_measured_again(tmp_path, capsys,
                                                                            monkeypatch):
    """issue 16: tuning-database rows are content-checked on read like every cache entry."""
    from stofc import cachecheck

    monkeypatch.setattr(cachecheck, "_warned", set())
    path = tmp_path / "t.sqlite"
    with TuningDatabase.open(path) as db:
        db.upsert_best(key(), '{"b":1}', 2.0)
        db.add_samples(key(), [Sample('{"b":1}', 2.0, None), Sample('{"b":2}', 3.0, None)])
    conn = sqlite3.connect(path)
    conn.execute("UPDATE records SET time_ms = 0.001")               # an edited record
    conn.execute("UPDATE samples SET config = '{\"b\":9}' WHERE config = '{\"b\":2}'")
    conn.commit()
    conn.close()
    capsys.readouterr()
    with TuningDatabase.open(path) as db:
        assert db.best(key()) is None                                  # not trusted
        assert set(db.samples(key())) == {'{"b":1}'}                   # the edited one goes
        assert db.counts_by_gpu() == {"NVIDIA H200": (0, 1)}           # and is deleted
        db.upsert_best(key(), '{"b":1}', 2.5)                          # measured again
        assert db.best(key()).time_ms == 2.5
    err = capsys.readouterr().err
    assert err.count("warning: ") == 1 and "does not match its digest" in err


def test_a_schema_1_database_gets_digests_for_its_rows(tmp_path, monkeypatch):
    import stofc.tune.db as dbmod

    path = tmp_path / "old.sqlite"
    monkeypatch.setattr(dbmod, "SCHEMA_VERSION", 1)
    with TuningDatabase.open(path) as db:
        db._conn.execute(
            "INSERT INTO records (family, problem, gpu, driver, stofc_version, compile_options, "
            "config, time_ms, created) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0)",
            (*key().as_params(), '{"b":1}', 2.0))
    monkeypatch.undo()
    with TuningDatabase.open(path) as db:
        assert db._conn.execute("SELECT version FROM schema_version").fetchone() == (2,)
        assert db.best(key()).time_ms == 2.0
