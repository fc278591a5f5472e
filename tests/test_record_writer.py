"""RecordWriter's fsyncs: the file's before its renames, the folders' in the background after an
append save, and every later save waits for them before it writes a byte."""

from __future__ import annotations

import errno
import threading

import pytest

from agent.record import durable
from agent.record.durable import RecordWriter

HEAD = b'{"meta":{},"entries":['


def body(items: list[bytes]):
    def chunks(start: int) -> list[bytes]:
        out = []
        for i in range(start, len(items)):
            out += [b",", items[i]] if i else [items[i]]
        return [*out, b"]}"]

    return chunks


def test_an_append_save_returns_before_the_folder_fsyncs_and_the_next_save_waits(
    tmp_path, monkeypatch
):
    gate, synced = threading.Event(), []

    def slow_sync(folder):
        assert gate.wait(10)
        synced.append(folder)

    monkeypatch.setattr(durable, "sync_dir", slow_sync)
    record, copy = tmp_path / "r.json", tmp_path / "copies" / "r.json"
    writer = RecordWriter(record, (copy,))
    items = [b"1"]
    writer.save(HEAD, 1, body(items), append=True)
    assert record.read_bytes() == HEAD + b"1]}" and synced == []  # published, not yet synced
    items.append(b"2")
    second = threading.Thread(
        target=writer.save, args=(HEAD, 2, body(items)), kwargs={"append": True}
    )
    second.start()
    second.join(0.5)
    assert second.is_alive()  # waiting for the first save's renames to be durable
    assert record.read_bytes() == HEAD + b"1]}"  # and nothing written meanwhile
    gate.set()
    second.join(10)
    assert not second.is_alive() and set(synced) == {tmp_path, tmp_path / "copies"}
    writer.flush()
    assert len(synced) == 4 and record.read_bytes() == HEAD + b"1,2]}" == copy.read_bytes()


def test_a_failed_background_fsync_is_raised_by_the_next_save_once(tmp_path, monkeypatch):
    def failing(folder):
        raise OSError(errno.EIO, "Input/output error", str(folder))

    monkeypatch.setattr(durable, "sync_dir", failing)
    writer = RecordWriter(tmp_path / "r.json")
    writer.save(HEAD, 1, body([b"1"]), append=True)  # the fault surfaces later, not lost
    with pytest.raises(OSError, match="Input/output error"):
        writer.save(HEAD, 1, body([b"1"]), append=True)
    monkeypatch.setattr(durable, "sync_dir", lambda folder: None)
    writer.save(HEAD, 1, body([b"1"]))  # the failure path's own save is not refused again
    assert (tmp_path / "r.json").read_bytes() == HEAD + b"1]}"


def test_other_saves_sync_the_folders_before_they_return(tmp_path, monkeypatch):
    synced = []
    monkeypatch.setattr(durable, "sync_dir", synced.append)
    RecordWriter(tmp_path / "r.json").save(HEAD, 1, body([b"1"]))
    assert synced == [tmp_path]
