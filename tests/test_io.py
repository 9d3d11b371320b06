"""Atomic directory writes (the adapter, the built-in model) survive a crash at any point: leftovers of an
interrupted write are recovered on the next write or load, never a reason for every later save to fail."""

import os
import shutil

import pytest

from grpo_lab.files import atomic_write_dir, recover_dir


def version(n):
    def write(tmp):
        (tmp / "adapter_model.safetensors").write_text(f"v{n}")

    return write


def content(path):
    return (path / "adapter_model.safetensors").read_text()


def test_a_leftover_old_directory_does_not_break_the_next_save(tmp_path):
    """Crash after the swap, before the old copy was removed: '.adapter.old' is left beside 'adapter'."""
    path = atomic_write_dir(tmp_path / "adapter", version(1))
    shutil.copytree(path, tmp_path / ".adapter.old")
    atomic_write_dir(path, version(2))
    assert content(path) == "v2" and not (tmp_path / ".adapter.old").exists()


def test_a_crash_between_the_two_renames_leaves_the_last_complete_version(tmp_path):
    """Crash after 'adapter' became '.adapter.old' and before the new one took its place: no 'adapter' at
    all. Loading (recover_dir) and the next save both put the last complete version back first."""
    path = atomic_write_dir(tmp_path / "adapter", version(1))
    os.replace(path, tmp_path / ".adapter.old")
    assert not path.exists()
    assert content(recover_dir(path)) == "v1" and not (tmp_path / ".adapter.old").exists()
    os.replace(path, tmp_path / ".adapter.old")
    atomic_write_dir(path, version(2))
    assert content(path) == "v2" and sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]


def test_unfinished_writes_are_cleaned_and_a_failed_write_keeps_the_previous_version(tmp_path):
    path = atomic_write_dir(tmp_path / "adapter", version(1))
    (tmp_path / ".adapter.tmp-crashed").mkdir()  # a write killed half-way
    (tmp_path / ".adapter.tmp-crashed" / "adapter_model.safetensors").write_text("half")
    (tmp_path / ".adapter.lock").write_text("")  # a lock file of the same prefix is not a leftover

    def failing(tmp):
        (tmp / "adapter_model.safetensors").write_text("partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write_dir(path, failing)
    assert content(path) == "v1"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".adapter.lock", "adapter"]


def test_a_text_write_is_fsynced_file_and_directory_before_and_after_its_rename(tmp_path, monkeypatch):
    """run.json and the rewound metrics.jsonl go through atomic_write_text; the README says writes are fsynced.
    A rename is only as durable as the file it names (fsynced before) and the directory entry (fsynced after)."""
    from grpo_lab.files import atomic_write_text

    synced, real_fsync, real_replace = [], os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda a, b: (synced.append(("rename", str(b))), real_replace(a, b)))
    path = atomic_write_text(tmp_path / "run.json", '{"status": "ok"}')
    assert path.read_text() == '{"status": "ok"}'
    rename = synced.index(("rename", str(path)))
    before, after = synced[:rename], synced[rename + 1 :]
    assert any(p.startswith(str(tmp_path / ".run.json.")) for p in before), synced  # the temporary file's data
    assert str(tmp_path) in after, synced  # then the directory entry
