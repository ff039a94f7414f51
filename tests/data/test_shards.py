"""Shard file format, ShardReader validation, manifest checks and the ShardedTokens virtual array."""

import json
import os
import pickle
import zlib

import numpy as np
import pytest
import torch

from titanlite.data.shards import (
    HEADER_SIZE,
    MANIFEST,
    ShardedTokens,
    ShardIntegrityError,
    ShardReader,
    build_manifest,
    dtype_for_vocab,
    write_json_atomic,
    write_shard,
)

TOK = {"path": "", "name": "bytes", "vocab_size": 512, "bos_id": 256, "eos_id": 257}


def make_docs(rng, n, vocab=512, max_len=50):
    return [[256] + rng.integers(0, 256, size=int(rng.integers(0, max_len))).tolist() + [257] for _ in range(n)]


def make_folder(tmp_path, shard_docs, dtype="uint16", split="train"):
    entries = []
    for i, docs in enumerate(shard_docs):
        info = write_shard(tmp_path / f"{split}-{i:05d}.bin", docs, dtype, fsync=False)
        entries.append({**info, "split": split})
    write_json_atomic(tmp_path / MANIFEST, build_manifest(entries, dtype, TOK))
    return entries


def test_dtype_for_vocab():
    assert dtype_for_vocab(512) == "uint16"
    assert dtype_for_vocab(65536) == "uint16"
    assert dtype_for_vocab(65537) == "uint32"
    assert dtype_for_vocab(128256) == "uint32"


@pytest.mark.parametrize("dtype, itemsize", [("uint16", 2), ("uint32", 4)])
def test_write_read_round_trip(tmp_path, dtype, itemsize):
    rng = np.random.default_rng(0)
    docs = make_docs(rng, 20)
    if dtype == "uint32":
        docs[3][1] = 100_000
    path = tmp_path / "s.bin"
    info = write_shard(path, docs, dtype, fsync=False)
    flat = [t for d in docs for t in d]
    crc = zlib.crc32(path.read_bytes())  # the checksum of the file as written, computed independently
    assert info == {
        "name": "s.bin",
        "tokens": len(flat),
        "docs": 20,
        "max_id": max(flat),
        "checksum": f"crc32:{crc:08x}",
    }
    assert ShardReader(path).checksum() == info["checksum"] and ShardReader(path).max_id() == max(flat)
    assert not (tmp_path / "s.bin.tmp").exists()
    assert path.stat().st_size == HEADER_SIZE + 8 * 21 + itemsize * len(flat)
    r = ShardReader(path)
    assert (r.num_tokens, r.num_docs, r.dtype.itemsize) == (len(flat), 20, itemsize)
    assert r.doc_offsets[0] == 0 and r.doc_offsets[-1] == len(flat)
    got = r[0 : len(flat)]
    assert got.dtype == torch.int64 and got.tolist() == flat
    assert r[5:9].tolist() == flat[5:9] and r[-3:].tolist() == flat[-3:] and r[7] == flat[7]
    assert r.doc(3).tolist() == docs[3]
    assert pickle.loads(pickle.dumps(r))[0:10].tolist() == flat[:10]


def test_uint16_overflow_rejected(tmp_path):
    with pytest.raises(ValueError, match="do not fit uint16"):
        write_shard(tmp_path / "s.bin", [[1, 70000]], "uint16", fsync=False)


def test_empty_shard(tmp_path):
    write_shard(tmp_path / "e.bin", [], "uint16", fsync=False)
    r = ShardReader(tmp_path / "e.bin")
    assert (r.num_tokens, r.num_docs, len(r[0:5])) == (0, 0, 0)


def test_corrupt_and_truncated_shards(tmp_path):
    path = tmp_path / "s.bin"
    write_shard(path, [[256, 1, 2, 3, 257], [256, 4, 257]], "uint16", fsync=False)
    data = path.read_bytes()

    def check(blob, needle):
        bad = tmp_path / "bad.bin"
        bad.write_bytes(blob)
        with pytest.raises(ValueError) as e:
            ShardReader(bad)
        msg = str(e.value)
        assert msg.startswith(f"{bad}: ") and needle in msg and "\n" not in msg, msg

    check(b"XXSHARD\0" + data[8:], "not a titanlite token shard")
    check(b"PK\x03\x04 a zip file, say" * 4, "not a titanlite token shard")
    check(b"", "not a titanlite token shard")
    check(data[:-1], "truncated shard")
    check(data[:20], "truncated shard")
    check(data[: HEADER_SIZE + 4], "truncated shard")
    check(data + b"\0\0", "trailing bytes")
    check(data[:8] + (9).to_bytes(4, "little") + data[12:], "unsupported shard format version 9")
    check(data[:12] + (3).to_bytes(4, "little") + data[16:], "bad dtype code 3")
    idx = bytearray(data)
    idx[HEADER_SIZE + 8 : HEADER_SIZE + 16] = (99).to_bytes(8, "little")
    check(bytes(idx), "corrupt document index")
    with pytest.raises(ValueError, match="shard file not found"):
        ShardReader(tmp_path / "missing.bin")


def test_sharded_tokens_crosses_boundaries(tmp_path):
    rng = np.random.default_rng(1)
    shard_docs = [make_docs(rng, 7), make_docs(rng, 1, max_len=3), make_docs(rng, 11)]
    make_folder(tmp_path, shard_docs)
    flat = [t for docs in shard_docs for d in docs for t in d]
    store = ShardedTokens(tmp_path, "train")
    assert len(store) == len(flat) and store.num_docs == 19
    assert (store.bos_id, store.eos_id, store.vocab_size, store.dtype) == (256, 257, 512, "uint16")
    ref = torch.tensor(flat)
    for a, b in [(0, len(flat)), (3, 40), (len(flat) - 5, len(flat)), (0, 1), (10, 10)]:
        got = store[a:b]
        assert got.dtype == torch.int64 and got.ndim == 1 and torch.equal(got, ref[a:b])
    for a in range(0, len(flat) - 9, 7):  # every shard boundary gets crossed by some window
        assert torch.equal(store[a : a + 9], ref[a : a + 9])
    assert store[len(flat) - 1] == flat[-1] and store[-1] == flat[-1]
    starts = [0, 5, len(flat) - 9, store.shard_starts[1] - 2]
    assert torch.equal(store.gather(starts, 9), torch.stack([ref[s : s + 9] for s in starts]))
    offs = store.doc_offsets()
    assert offs[0] == 0 and offs[-1] == len(flat) and len(offs) == 20
    assert all(flat[o] == 256 for o in offs[:-1]) and all(flat[o - 1] == 257 for o in offs[1:])
    clone = pickle.loads(pickle.dumps(store))
    assert torch.equal(clone[0 : len(flat)], ref)


def test_sharded_tokens_checks_manifest(tmp_path):
    rng = np.random.default_rng(2)
    make_folder(tmp_path, [make_docs(rng, 3), make_docs(rng, 4)])
    with pytest.raises(ValueError, match="split 'val' has no shards"):
        ShardedTokens(tmp_path, "val")
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    manifest["shards"][1]["tokens"] += 1
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"train-00001\.bin: header says .*/manifest\.json says"):
        ShardedTokens(tmp_path)
    manifest["shards"][1]["tokens"] -= 1
    manifest["dtype"] = "uint32"
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"train-00000\.bin: dtype uint16 differs"):
        ShardedTokens(tmp_path)
    os.remove(tmp_path / MANIFEST)
    with pytest.raises(ValueError, match=r"manifest\.json: not found"):
        ShardedTokens(tmp_path)
    (tmp_path / MANIFEST).write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ShardedTokens(tmp_path)


# --- integrity: recorded max id (checked at start) and checksum (checked on a shard's first read) ---------


def overwrite_token(path, index, value, itemsize=2):
    """Change token ``index`` of a shard file in place (what bit rot or a bad copy does)."""
    r = ShardReader(path)
    at = HEADER_SIZE + 8 * (r.num_docs + 1) + itemsize * index
    del r
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(int(value).to_bytes(itemsize, "little"))


def test_altered_shard_refused_before_its_tokens_are_read(tmp_path):
    rng = np.random.default_rng(3)
    shard_docs = [make_docs(rng, 5), make_docs(rng, 5), make_docs(rng, 5)]
    make_folder(tmp_path, shard_docs)
    bad = tmp_path / "train-00001.bin"
    overwrite_token(bad, 7, 65535)
    assert ShardReader(bad)[7] == 65535  # unchecked, this id would reach the embedding (IndexError / CUDA assert)
    store = ShardedTokens(tmp_path)  # start-up reads headers only: the damage is not seen yet
    s1, s2 = store.shard_starts[1], store.shard_starts[2]
    flat0 = [t for d in shard_docs[0] for t in d]
    assert store[0:s1].tolist() == flat0  # shard 0 is intact and verified on its own
    for window in [(s1 + 10, s1 + 12), (s1 - 2, s1 + 1), (s1, s2)]:  # any read touching shard 1, the bad id or not
        with pytest.raises(ValueError) as e:
            store[window[0] : window[1]]
        msg = str(e.value)
        assert msg.startswith(f"{bad}: checksum ") and "changed after it was prepared" in msg and "\n" not in msg
    with pytest.raises(ShardIntegrityError, match=r"train-00001\.bin: checksum"):
        store.gather([0, s1 + 1], 3)
    with pytest.raises(ShardIntegrityError, match=r"train-00001\.bin: checksum"):
        store[s1 + 2]
    assert store[s2 : s2 + 3].tolist() == [t for d in shard_docs[2] for t in d][:3]


def test_in_range_change_is_caught_too(tmp_path):
    rng = np.random.default_rng(4)
    make_folder(tmp_path, [make_docs(rng, 4)])
    overwrite_token(tmp_path / "train-00000.bin", 3, 1)  # a valid id: only the checksum can tell
    with pytest.raises(ValueError, match=r"train-00000\.bin: checksum crc32:\w{8} differs from crc32:\w{8}"):
        ShardedTokens(tmp_path)[0:4]


def test_each_shard_is_hashed_once_per_process(tmp_path, monkeypatch):
    rng = np.random.default_rng(5)
    make_folder(tmp_path, [make_docs(rng, 6), make_docs(rng, 6)])
    calls = []
    original = ShardReader.checksum
    monkeypatch.setattr(ShardReader, "checksum", lambda self: calls.append(self.path.name) or original(self))
    store = ShardedTokens(tmp_path)
    assert calls == []  # nothing hashed at start
    for a in range(0, len(store) - 8, 5):
        store[a : a + 8]
    assert sorted(calls) == ["train-00000.bin", "train-00001.bin"]
    clone = pickle.loads(pickle.dumps(store))  # e.g. a DataLoader worker: it checks for itself
    clone[0:4]
    assert calls[-1] == "train-00000.bin" and len(calls) == 3


def test_recorded_max_id_outside_vocab_refused_at_start(tmp_path):
    rng = np.random.default_rng(6)
    make_folder(tmp_path, [make_docs(rng, 3), make_docs(rng, 3)])
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert [e["max_id"] for e in manifest["shards"]] == [257, 257]  # EOS: the largest id of these shards
    manifest["tokenizer"]["vocab_size"] = 257  # as if the shards had been made for a larger vocabulary
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ValueError) as e:
        ShardedTokens(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / 'train-00000.bin'}: ") and "token id 257, outside the vocab" in str(e)


def test_old_manifest_without_checks_loads_with_warnings(tmp_path, caplog):
    rng = np.random.default_rng(7)
    shard_docs = [make_docs(rng, 4), make_docs(rng, 4)]
    make_folder(tmp_path, shard_docs)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    for e in manifest["shards"]:  # what titanlite wrote before max_id and checksum existed
        del e["max_id"], e["checksum"]
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    with caplog.at_level("WARNING", logger="titanlite.data.shards"):
        store = ShardedTokens(tmp_path)
    assert "2 of the 2 train shards have no recorded checksum" in caplog.text
    flat = [t for docs in shard_docs for d in docs for t in d]
    assert store[0 : len(flat)].tolist() == flat
    overwrite_token(tmp_path / "train-00001.bin", 2, 600)  # outside the 512-token vocabulary
    store = ShardedTokens(tmp_path)
    assert store[0:5].tolist() == flat[:5]
    with pytest.raises(ValueError, match=r"train-00001\.bin: holds token id 600, outside the vocabulary of 512"):
        store[store.shard_starts[1] : store.shard_starts[1] + 1]


def test_manifest_check_fields_are_validated(tmp_path):
    rng = np.random.default_rng(8)
    make_folder(tmp_path, [make_docs(rng, 2)])
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    for key, value, needle in [("max_id", "7", "max_id must be an integer"), ("checksum", "md5:1", "checksum must")]:
        broken = json.loads(json.dumps(manifest))
        broken["shards"][0][key] = value
        (tmp_path / MANIFEST).write_text(json.dumps(broken))
        with pytest.raises(ValueError, match=rf"manifest\.json: shard entry 0 \(train-00000\.bin\): {needle}"):
            ShardedTokens(tmp_path)
