"""The one artifact store contract, run against every store: a local folder, fsspec's
``memory://`` and S3 (moto's server on loopback, through s3fs).

Content-addressed, atomic (a write in progress or failed is never visible under its final
name), verified on read, streamed in chunks, ids and manifest paths that cannot escape.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import pickle
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import S3Server

from llmtrain.errors import ArtifactCorruptError, ConfigError, StoreError
from llmtrain.stores.artifacts import LocalArtifactStore, open_artifacts
from llmtrain.stores.artifacts.base import (
    CHUNK,
    ArtifactStore,
    manifest_bytes,
)
from llmtrain.stores.artifacts.fsspec_store import FsspecArtifactStore

BAD_IDS = [
    "sha256:../../etc/passwd",
    "sha256:" + "a" * 63 + "/",
    "tree:..",
    "../x",
    "",
    "sha256:" + "A" * 64,
    "sha256:" + "g" * 64,
    "sha256:" + "a" * 65,
    "blob:" + "a" * 64,
    "sha256:" + "a" * 64 + "\n",
    "tree:" + "a" * 62 + "/..",
]


STORES = ["local", "memory", "s3"]
PART = 5 << 20  # the smallest S3 multipart part


@pytest.fixture(scope="module")
def s3_bucket(s3_server: S3Server) -> str:
    return s3_server.new_bucket()


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ArtifactStore]:
    """A fresh, empty store of each kind (an S3 store is a fresh prefix of one bucket)."""
    unique = uuid.uuid4().hex
    if request.param == "local":
        yield open_artifacts(tmp_path / "artifacts")
    elif request.param == "memory":
        memory = open_artifacts(f"memory://lt-{unique}/arts")
        yield memory
        assert isinstance(memory, FsspecArtifactStore)
        if memory.fs.exists(f"/lt-{unique}"):
            memory.fs.rm(f"/lt-{unique}", recursive=True)
    else:
        bucket = request.getfixturevalue("s3_bucket")
        yield open_artifacts(f"s3://{bucket}/{unique}/arts")


@pytest.fixture
def local(tmp_path: Path) -> LocalArtifactStore:
    return LocalArtifactStore(tmp_path / "artifacts")


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A checkpoint-like folder: nested, binary, empty and duplicate-content files."""
    root = tmp_path / "ckpt"
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "adapter.safetensors").write_bytes(os.urandom(3 * 1024 * 1024 + 7))  # > 1 chunk
    (root / "config.json").write_text('{"r": 8}')
    (root / "sub" / "same.json").write_text('{"r": 8}')
    (root / "sub" / "deeper" / "empty").write_bytes(b"")
    (root / "sub" / "ünïcode name.txt").write_text("ok")
    return root


def snapshot(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def all_files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def corrupt(store: ArtifactStore, artifact_id: str) -> None:
    """Flip one byte of the stored content behind the store's back."""
    if isinstance(store, LocalArtifactStore):
        path = store._path(artifact_id)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        return
    assert isinstance(store, FsspecArtifactStore)
    path = store._path(artifact_id)
    data = bytearray(store.fs.cat_file(path))
    data[len(data) // 2] ^= 0xFF
    store.fs.pipe_file(path, bytes(data))


def store_raw(store: ArtifactStore, artifact_id: str, data: bytes) -> None:
    """Write content under an id through the store's primitive, as a crafted store would."""
    import io

    assert isinstance(store, ArtifactStore)
    store._save(artifact_id, io.BytesIO(data))


# -- round trips ----------------------------------------------------------------------------------
def test_open_artifacts_dispatch(tmp_path: Path) -> None:
    assert isinstance(open_artifacts(tmp_path), LocalArtifactStore)
    assert isinstance(open_artifacts(str(tmp_path)), LocalArtifactStore)
    with pytest.raises(ConfigError, match="'gridfs' is no longer supported: use a folder or an"):
        open_artifacts("gridfs")


def test_bytes_round_trip_and_dedup(store: ArtifactStore) -> None:
    data = b"\x00weights\xff" * 1000
    artifact_id = store.put_bytes(data)
    assert artifact_id == "sha256:" + hashlib.sha256(data).hexdigest()
    assert store.put(data) == artifact_id == store.put_bytes(data)
    assert store.exists(artifact_id) and store.get_bytes(artifact_id) == data
    assert pickle.loads(pickle.dumps(store)).get_bytes(artifact_id) == data  # for workers
    assert store.get_bytes(store.put_bytes(b"")) == b""
    assert not store.exists("sha256:" + "0" * 64)
    with pytest.raises(StoreError, match="not found"):
        store.get_bytes("sha256:" + "0" * 64)


def test_file_round_trip(store: ArtifactStore, tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    data = os.urandom(2 * 1024 * 1024 + 3)
    path.write_bytes(data)
    artifact_id = store.put(path)
    assert artifact_id == store.put_file(str(path)) == store.put_bytes(data)
    assert store.get_bytes(artifact_id) == data
    with pytest.raises(StoreError, match="not a regular file"):
        store.put_file(tmp_path / "missing")


def test_folder_round_trip(store: ArtifactStore, folder: Path, tmp_path: Path) -> None:
    tree_id = store.put(folder)
    assert tree_id.startswith("tree:") and store.exists(tree_id)
    assert store.put_dir(folder) == tree_id
    copy = tmp_path / "copy"  # same content elsewhere: same id
    os.rename(folder, copy)
    assert store.put_dir(copy) == tree_id
    out = store.get_dir(tree_id, tmp_path / "restored" / "here")
    assert out == tmp_path / "restored" / "here"
    assert snapshot(out) == snapshot(copy)
    empty = tmp_path / "empty_dest"
    empty.mkdir()
    assert snapshot(store.get_dir(tree_id, empty)) == snapshot(copy)
    assert [p.name for p in (tmp_path / "restored").iterdir()] == ["here"]  # no staging left


def test_get_dir_refuses_a_non_empty_destination(
    store: ArtifactStore, folder: Path, tmp_path: Path
) -> None:
    tree_id = store.put_dir(folder)
    dest = tmp_path / "busy"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    with pytest.raises(StoreError, match="not an empty folder"):
        store.get_dir(tree_id, dest)
    assert all_files(dest) == ["keep.txt"]
    with pytest.raises(StoreError, match="is a blob, not a folder"):
        store.get_dir(store.put_bytes(b"x"), tmp_path / "blob")


def test_empty_folder_round_trip(store: ArtifactStore, tmp_path: Path) -> None:
    (tmp_path / "nothing").mkdir()
    tree_id = store.put_dir(tmp_path / "nothing")
    assert store.get_dir(tree_id, tmp_path / "out").is_dir()
    assert list((tmp_path / "out").iterdir()) == []


# -- integrity ------------------------------------------------------------------------------------
def test_corrupt_blob_is_detected(store: ArtifactStore) -> None:
    artifact_id = store.put_bytes(b"precious weights" * 100)
    corrupt(store, artifact_id)
    with pytest.raises(ArtifactCorruptError, match=artifact_id):
        store.get_bytes(artifact_id)


def test_corrupt_file_in_a_folder_fails_get_dir_and_leaves_nothing(
    store: ArtifactStore, folder: Path, tmp_path: Path
) -> None:
    tree_id = store.put_dir(folder)
    blob_id = store.put_file(folder / "sub" / "ünïcode name.txt")
    corrupt(store, blob_id)
    with pytest.raises(ArtifactCorruptError, match=blob_id):
        store.get_dir(tree_id, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if ".partial" in p.name] == []


def test_corrupt_manifest_is_detected(store: ArtifactStore, folder: Path, tmp_path: Path) -> None:
    tree_id = store.put_dir(folder)
    corrupt(store, tree_id)
    with pytest.raises(ArtifactCorruptError, match=tree_id):
        store.get_dir(tree_id, tmp_path / "out")
    store.delete(tree_id)  # a corrupt tree can still be deleted (its blobs are kept)
    assert not store.exists(tree_id)
    assert store.exists(store.put_file(folder / "config.json"))


@pytest.mark.parametrize("bad_id", BAD_IDS)
def test_crafted_ids_are_refused(store: ArtifactStore, bad_id: str, tmp_path: Path) -> None:
    for call in (
        store.get_bytes,
        store.exists,
        store.delete,
        lambda i: store.get_dir(i, tmp_path / "out"),
    ):
        with pytest.raises(StoreError, match="invalid artifact id"):
            call(bad_id)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "relpath",
    ["../evil.txt", "/tmp/evil.txt", "a/../../evil.txt", "a//b", "./a", "a\\..\\evil.txt", ""],
)
def test_crafted_manifest_paths_are_refused(
    store: ArtifactStore, relpath: str, tmp_path: Path
) -> None:
    blob_id = store.put_bytes(b"payload")
    manifest = manifest_bytes({"ok.txt": blob_id, relpath: blob_id})
    tree_id = "tree:" + hashlib.sha256(manifest).hexdigest()
    store_raw(store, tree_id, manifest)
    with pytest.raises(StoreError, match="unsafe path"):
        store.get_dir(tree_id, tmp_path / "out" / "dest")
    assert not (tmp_path / "out").exists() and not (tmp_path / "evil.txt").exists()


def test_manifest_that_names_a_tree_or_junk_is_refused(
    store: ArtifactStore, tmp_path: Path
) -> None:
    for manifest in (
        manifest_bytes({"x": "tree:" + "0" * 64}),
        b"not json",
        b'{"format": 2, "files": {}}',
    ):
        tree_id = "tree:" + hashlib.sha256(manifest).hexdigest()
        store_raw(store, tree_id, manifest)
        with pytest.raises(StoreError):
            store.get_dir(tree_id, tmp_path / "out")
        assert not (tmp_path / "out").exists()


def test_a_file_that_changes_while_stored_is_not_published(
    store: ArtifactStore, tmp_path: Path
) -> None:
    import io

    claimed = "sha256:" + hashlib.sha256(b"original").hexdigest()
    with pytest.raises(StoreError, match="changed while it was being stored"):
        store._save(claimed, io.BytesIO(b"tampered"))  # type: ignore[attr-defined]
    assert not store.exists(claimed)


class Source:
    """``size`` bytes handed out as asked; at ``check_at`` bytes it asks whether the id is
    visible yet, and it fails there when ``fail`` (a writer that crashed mid-file)."""

    def __init__(self, data: bytes, check_at: int, probe: Any, fail: bool) -> None:
        self.raw, self.check_at, self.probe, self.fail = io.BytesIO(data), check_at, probe, fail
        self.largest_read, self.seen_mid_write = 0, None

    def read(self, size: int = -1) -> bytes:
        self.largest_read = max(self.largest_read, size)
        if self.seen_mid_write is None and self.raw.tell() >= self.check_at:
            self.seen_mid_write = self.probe()
            if self.fail:
                raise RuntimeError("the writer died here")
        return self.raw.read(size)


def pending(store: ArtifactStore) -> list[str]:
    """What a write leaves outside the store's published names: temporary files, fsspec
    temporaries and unfinished S3 multipart uploads."""
    if isinstance(store, LocalArtifactStore):
        return leftovers(store.root)
    assert isinstance(store, FsspecArtifactStore)
    found = [p for p in store.fs.find(store._join("")) if "/tmp/" in p]
    if store.protocol == "s3":
        bucket, _, prefix = store._join("").partition("/")
        uploads = store.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
        found += [u["Key"] for u in uploads.get("Uploads", [])]
    return found


def test_a_large_write_streams_and_is_invisible_until_complete(
    store: ArtifactStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bigger than one S3 part: when the writer looks, and dies, bytes were already sent, so
    the write really is in flight."""
    from llmtrain.stores.artifacts import fsspec_store

    monkeypatch.setattr(fsspec_store, "WRITE_BLOCK", PART)  # S3's smallest part: less to send
    data = os.urandom(PART + 2 * CHUNK + 5)
    artifact_id = "sha256:" + hashlib.sha256(data).hexdigest()
    assert isinstance(store, ArtifactStore)

    def probe() -> tuple[bool, int]:
        return store.exists(artifact_id), len(pending(store))

    dying = Source(data, PART + 2 * CHUNK, probe, fail=True)
    with pytest.raises(RuntimeError, match="the writer died here"):
        store._save(artifact_id, dying)  # type: ignore[arg-type]
    # half-way: the bytes are somewhere (temp file, chunks, uploaded parts), not under the id
    assert dying.seen_mid_write is not None and dying.seen_mid_write[0] is False
    assert dying.seen_mid_write[1] >= 1, "nothing was sent before the end: not streamed"
    assert not store.exists(artifact_id) and pending(store) == []
    if isinstance(store, FsspecArtifactStore):  # a kill -9: nobody cleans up after the write
        with monkeypatch.context() as crash:
            crash.setattr(store, "_abandon", lambda *args: None)
            with pytest.raises(RuntimeError, match="the writer died here"):
                store._save(artifact_id, Source(data, PART + 2 * CHUNK, probe, fail=True))  # type: ignore[arg-type]
        assert not store.exists(artifact_id) and len(pending(store)) == 1  # invisible leftover

    whole = Source(data, PART + 2 * CHUNK, probe, fail=False)
    store._save(artifact_id, whole)  # type: ignore[arg-type]
    assert whole.seen_mid_write is not None and whole.seen_mid_write[0] is False
    assert whole.largest_read <= CHUNK
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "weights.bin").write_bytes(data)
    tree_id = store.put_dir(tmp_path / "big")

    reads: list[int] = []
    open_blob = store._open

    def counted(blob_id: str) -> Any:
        stream = open_blob(blob_id)
        read = stream.read

        def read_counted(size: int = -1) -> bytes:
            reads.append(size)
            return read(size)

        stream.read = read_counted  # type: ignore[method-assign]
        return stream

    monkeypatch.setattr(store, "_open", counted)
    out = store.get_dir(tree_id, tmp_path / "out")
    assert (out / "weights.bin").read_bytes() == data
    assert reads and -1 not in reads[1:] and max(reads[1:]) <= CHUNK  # [0]: the manifest


def test_a_url_store_writes_nothing_outside_its_prefix(
    s3_server: S3Server, folder: Path, tmp_path: Path
) -> None:
    s3_bucket = s3_server.new_bucket()
    inner = open_artifacts(f"s3://{s3_bucket}/pre/fix")
    beside = open_artifacts(f"s3://{s3_bucket}/pre/fix2")
    assert isinstance(inner, FsspecArtifactStore) and isinstance(beside, FsspecArtifactStore)
    other = beside.put_bytes(b"neighbour")
    tree_id = inner.put_dir(folder)
    assert inner.get_bytes(inner.put_bytes(b"x")) == b"x"
    assert inner._tree_ids() == [tree_id] and beside._tree_ids() == []
    inner.delete(tree_id)
    outside = [k for k in inner.fs.find(s3_bucket) if not k.startswith(f"{s3_bucket}/pre/fix/")]
    assert outside == [beside._path(other)]  # the neighbour's, untouched
    assert beside.get_bytes(other) == b"neighbour"


@pytest.mark.parametrize(
    "url",
    [
        "s3://AKIAEXAMPLE:hunter2@bucket/prefix",
        "s3://hunter2@bucket/prefix",
        "s3://bucket/prefix?secret_access_key=hunter2",
        "s3://bucket/prefix#hunter2",
    ],
)
def test_a_url_with_credentials_is_refused_without_repeating_them(url: str) -> None:
    with pytest.raises(ConfigError, match="do not belong in the URL") as info:
        open_artifacts(url)
    assert "hunter2" not in str(info.value) and "AKIAEXAMPLE" not in str(info.value)


def test_a_url_store_travels_to_workers_as_its_url(tmp_path: Path) -> None:
    import llmtrain as lt
    from llmtrain.running.launchers.command import artifacts_location

    db = lt.connect(f"sqlite:///{tmp_path / 'x.db'}", artifacts="memory://team/arts")
    assert artifacts_location(db) == "memory://team/arts"
    assert isinstance(pickle.loads(pickle.dumps(db)).artifacts, FsspecArtifactStore)


def test_url_checks(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'..' are not allowed"):
        open_artifacts("s3://bucket/a/../b")
    with pytest.raises(ConfigError, match="no artifact store handles http://"):
        open_artifacts("http://host/x")
    store = open_artifacts("memory://somewhere/arts/")
    assert isinstance(store, FsspecArtifactStore) and store.url == "memory://somewhere/arts"


# -- deletion -------------------------------------------------------------------------------------
def test_delete_tree_keeps_blobs_other_trees_use(store: ArtifactStore, tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "shared.bin").write_bytes(b"shared")
    (b / "shared.bin").write_bytes(b"shared")
    (a / "only_a.bin").write_bytes(b"only a")
    (b / "only_b.bin").write_bytes(b"only b")
    tree_a, tree_b = store.put_dir(a), store.put_dir(b)
    shared, only_a = store.put_bytes(b"shared"), store.put_bytes(b"only a")
    with pytest.raises(StoreError, match="is part of tree:"):
        store.delete(shared)
    store.delete(tree_a)
    assert not store.exists(tree_a) and not store.exists(only_a)
    assert store.exists(shared) and store.exists(tree_b)
    assert snapshot(store.get_dir(tree_b, tmp_path / "out")) == snapshot(b)
    store.delete(tree_a)  # gone already: no-op
    store.delete(tree_b)
    assert not store.exists(shared)
    loose = store.put_bytes(b"loose")
    store.delete(loose)
    assert not store.exists(loose)


def test_local_layout_is_content_addressed(local: LocalArtifactStore, folder: Path) -> None:
    blob_id = local.put_bytes(b"abc")
    hexdigest = blob_id.split(":")[1]
    assert (local.root / "blobs" / hexdigest[:2] / hexdigest[2:]).read_bytes() == b"abc"
    tree_id = local.put_dir(folder)
    hexdigest = tree_id.split(":")[1]
    manifest = (local.root / "trees" / hexdigest[:2] / hexdigest[2:]).read_bytes()
    assert hashlib.sha256(manifest).hexdigest() == hexdigest
    assert sorted(json.loads(manifest)["files"]) == all_files(folder)


# -- failures while writing (local folder) --------------------------------------------------------
def leftovers(root: Path) -> list[str]:
    return [p for p in all_files(root) if Path(p).name.startswith(".tmp-")] if root.exists() else []


def test_failed_rename_leaves_no_blob_and_no_temp(
    local: LocalArtifactStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    local.put_bytes(b"first")  # the folders exist already

    def broken_replace(*_args: Any, **_kwargs: Any) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(StoreError, match="Input/output error"):
        local.put_bytes(b"second")
    monkeypatch.undo()
    assert not local.exists("sha256:" + hashlib.sha256(b"second").hexdigest())
    assert leftovers(local.root) == []
    assert len(all_files(local.root / "blobs")) == 1


def test_disk_full_gives_a_clear_store_error(
    local: LocalArtifactStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(_fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    (tmp_path / "f.bin").write_bytes(b"big" * 1000)
    with pytest.raises(StoreError, match=r"No space left on device \(disk full\?\)"):
        local.put_file(tmp_path / "f.bin")
    monkeypatch.undo()
    assert leftovers(local.root) == [] and all_files(local.root / "blobs") == []


def test_root_that_is_a_file_gives_store_error(tmp_path: Path) -> None:
    (tmp_path / "not_a_dir").write_text("x")
    store = LocalArtifactStore(tmp_path / "not_a_dir")
    with pytest.raises(StoreError, match="cannot write artifacts under"):
        store.put_bytes(b"data")
    assert (tmp_path / "not_a_dir").read_text() == "x"
    assert not store.exists("sha256:" + hashlib.sha256(b"data").hexdigest())


def test_failed_get_dir_leaves_no_partial_folder(
    local: LocalArtifactStore, folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree_id = local.put_dir(folder)
    real_open = open
    calls = {"n": 0}

    def flaky_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if mode == "xb":
            calls["n"] += 1
            if calls["n"] == 3:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", flaky_open)
    with pytest.raises(StoreError, match="No space left"):
        local.get_dir(tree_id, tmp_path / "out")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["artifacts", "ckpt"]
