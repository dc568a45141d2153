"""The data behind `orthoptim train`: the built-in corpus builder, the .bin shard reader, --data forms."""

from __future__ import annotations

import hashlib
import struct
import sysconfig
from pathlib import Path

import pytest
import torch

from orthoptim.train import data


def _write_tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.bin"))}


def test_builtin_corpus_is_deterministic_and_cached(tmp_path):
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    a = data.builtin_corpus(tmp_path / "a", cap_bytes=256 * 1024)
    b = data.builtin_corpus(tmp_path / "b", cap_bytes=256 * 1024)
    folder_a, folder_b = (next((tmp_path / x / "corpus").iterdir()) for x in ("a", "b"))
    assert _digest(folder_a) == _digest(folder_b)
    assert len(_digest(folder_a)) == 2
    assert torch.equal(a.train[0], b.train[0]) and torch.equal(a.val[0], b.val[0])
    assert a.vocab_size == 256 and a.bytes_per_token == 1.0
    assert a.num_tokens("train") >= 256 * 1024 * 0.8 and a.num_tokens("val") > 0
    assert str(stdlib) in (folder_a / "meta.json").read_text()
    # second call reads the cache: same tensors, no rebuild (the shard files keep their mtime)
    mtime = (folder_a / "train.bin").stat().st_mtime_ns
    again = data.builtin_corpus(tmp_path / "a", cap_bytes=256 * 1024)
    assert torch.equal(again.train[0], a.train[0])
    assert (folder_a / "train.bin").stat().st_mtime_ns == mtime


def test_corpus_split_by_file_and_order_independent(tmp_path):
    files = {f"pkg{i % 3}/mod{i}.py": f"# module {i}\n" + "x = 1\n" * (i + 1) for i in range(60)}
    files["test/test_skip.py"] = "SKIPPED\n"
    _write_tree(tmp_path / "src", files)
    meta = data.build_corpus(tmp_path / "src", tmp_path / "out", cap_bytes=None)
    assert meta["files"]["train"] + meta["files"]["val"] == 60  # the test/ folder is left out
    assert meta["files"]["val"] >= 1
    train = bytes(data.read_shard(tmp_path / "out" / "train.bin").tolist())
    val = bytes(data.read_shard(tmp_path / "out" / "val.bin").tolist())
    assert b"SKIPPED" not in train + val
    train_modules = {line for line in train.split(b"\n") if line.startswith(b"# module")}
    val_modules = {line for line in val.split(b"\n") if line.startswith(b"# module")}
    assert not train_modules & val_modules and len(train_modules | val_modules) == 60
    # a rebuild gives the same bytes
    data.build_corpus(tmp_path / "src", tmp_path / "out2", cap_bytes=None)
    assert _digest(tmp_path / "out") == _digest(tmp_path / "out2")


def _handmade_shard(path: Path, tokens: list[int], magic: int = 20240520, version: int = 1,
                    count: int | None = None) -> None:
    header = [magic, version, len(tokens) if count is None else count] + [0] * 253
    path.write_bytes(struct.pack("<256i", *header) + struct.pack(f"<{len(tokens)}H", *tokens))


def test_bin_reader_on_a_shard_written_here(tmp_path):
    tokens = [0, 1, 2, 50256, 65535, 7] * 50
    _handmade_shard(tmp_path / "shard.bin", tokens)
    read = data.read_shard(tmp_path / "shard.bin")
    assert read.dtype == torch.uint16 and read.to(torch.int64).tolist() == tokens
    data.write_shard(tmp_path / "again.bin", torch.tensor(tokens))
    assert (tmp_path / "again.bin").read_bytes() == (tmp_path / "shard.bin").read_bytes()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"magic": 12345}, "header magic is 12345"),
    ({"version": 7}, "shard version 7"),
    ({"count": 999}, "truncated"),
])
def test_bad_shards_are_named(tmp_path, kwargs, message):
    _handmade_shard(tmp_path / "bad.bin", [1, 2, 3], **kwargs)
    with pytest.raises(data.DataError, match=message):
        data.read_shard(tmp_path / "bad.bin")
    (tmp_path / "short.bin").write_bytes(b"\0" * 100)
    with pytest.raises(data.DataError, match="shorter than the 1024-byte header"):
        data.read_shard(tmp_path / "short.bin")


def test_shard_folder_train_and_val(tmp_path):
    _handmade_shard(tmp_path / "fineweb_train_000001.bin", list(range(1000)))
    _handmade_shard(tmp_path / "fineweb_train_000002.bin", list(range(200, 1000)))
    _handmade_shard(tmp_path / "fineweb_val_000000.bin", list(range(300)))
    ds = data.load_data(tmp_path)
    assert len(ds.train) == 2 and len(ds.val) == 1
    assert ds.vocab_size == 1024  # largest id in the first train shard and val (999) + 1, rounded up to 64
    assert ds.bytes_per_token is None
    x, y = ds.batch("train", 8, 16, seed=0, step=3)
    assert x.shape == (8, 16) and torch.equal(x[:, 1:], y[:, :-1])
    assert torch.all(y - x == 1)  # consecutive ids: no window crosses from one shard into the next
    x2, _ = ds.batch("train", 8, 16, seed=0, step=3)
    x3, _ = ds.batch("train", 8, 16, seed=0, step=4)
    assert torch.equal(x, x2) and not torch.equal(x, x3)
    # ids beyond the first shard's vocabulary are caught by the batch, with the fix
    ds.vocab_size = 64
    with pytest.raises(data.DataError, match="--vocab-size"):
        for step in range(20):
            ds.batch("train", 8, 16, seed=0, step=step)


def test_single_shard_holds_out_its_tail(tmp_path):
    _handmade_shard(tmp_path / "one.bin", list(range(2000)))
    ds = data.load_data(tmp_path / "one.bin")
    assert ds.num_tokens("train") == 1900 and ds.num_tokens("val") == 100
    assert int(ds.val[0][0]) == 1900


def test_text_file_and_text_folder(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n" * 200)
    ds = data.load_data(tmp_path / "a.txt")
    assert ds.vocab_size == 256 and ds.num_tokens("train") + ds.num_tokens("val") == 2400
    _write_tree(tmp_path / "docs", {f"d{i}.md": f"doc {i}\n" * 40 for i in range(30)})
    folder = data.load_data(tmp_path / "docs")
    assert folder.num_tokens("val") > 0 and "text folder" in folder.description


@pytest.mark.parametrize(("setup", "message"), [
    (lambda p: None, "no such file or folder"),
    (lambda p: p.mkdir(), "no .bin shards and no text files"),
    (lambda p: p.write_bytes(b"\x00\x01binary"), "looks binary"),
])
def test_bad_data_paths(tmp_path, setup, message):
    target = tmp_path / "data"
    setup(target)
    with pytest.raises(data.DataError, match=message):
        data.load_data(target)


def test_too_little_data_for_the_context(tmp_path):
    (tmp_path / "tiny.txt").write_text("abc" * 10)
    ds = data.load_data(tmp_path / "tiny.txt")
    with pytest.raises(data.DataError, match="shorter --context"):
        data.check_fits(ds, 128)


def test_an_empty_text_file_is_named(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(data.DataError, match=r"empty\.txt: the file is empty"):
        data.load_data(tmp_path / "empty.txt")


def test_a_folder_whose_only_file_hashes_to_validation_still_trains(tmp_path):
    """One file in a folder: its end is held out, whatever its name's hash would send it to."""
    name = next(f"f{i}.txt" for i in range(100) if data._path_hash(f"f{i}.txt") % data.VAL_ONE_IN == 0)
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / name).write_text("some text to train on\n" * 100)
    ds = data.load_data(tmp_path / "one")
    assert ds.num_tokens("train") > 0 and ds.num_tokens("val") > 0
    data.check_fits(ds, 16)


def test_a_folder_of_a_few_uneven_files_holds_out_the_end_of_its_text(tmp_path):
    """Two files, the larger sorting last: the split by file held out 70 % of the bytes."""
    _write_tree(tmp_path / "two", {"a.md": "short\n" * 300, "b.md": "the longer one\n" * 500})
    ds = data.load_data(tmp_path / "two")
    total = ds.num_tokens("train") + ds.num_tokens("val")
    assert total == 1800 + 7500 + 2 and ds.num_tokens("val") == int(total * 0.05), ds.description
    assert "held out" in ds.description


def test_a_corpus_sample_too_small_for_both_splits_names_corpus_mb(tmp_path):
    source = tmp_path / "src"
    _write_tree(source, {f"m{i}.py": "x = 1\n" * 50 for i in range(20)})
    with pytest.raises(data.DataError, match=r"--corpus-mb .* too small"):
        data.build_corpus(source, tmp_path / "out", cap_bytes=10)


@pytest.mark.parametrize("damage", ["flip a token", "token above a byte", "meta.json", "truncate"])
def test_a_damaged_corpus_cache_is_rebuilt(tmp_path, damage):
    """The cache was read as it was: a train.bin overwritten with other bytes trained silently."""
    good = data.builtin_corpus(tmp_path, cap_bytes=64 * 1024)
    good_train, good_val = good.train[0].clone(), good.val[0].clone()  # the shards are memory-mapped
    folder = next((tmp_path / "corpus").iterdir())
    shard = folder / "train.bin"
    tokens = data.read_shard(shard).clone()
    if damage == "flip a token":
        tokens[10] = (int(tokens[10]) + 1) % 256
        data.write_shard(shard, tokens)
    elif damage == "token above a byte":  # its low byte unchanged: a byte-wise digest alone would pass it
        tokens[10] = int(tokens[10]) + 256
        data.write_shard(shard, tokens)
    elif damage == "meta.json":
        (folder / "meta.json").write_text("{not json")
    else:
        shard.write_bytes(shard.read_bytes()[:-10])
    again = data.builtin_corpus(tmp_path, cap_bytes=64 * 1024)
    assert torch.equal(again.train[0], good_train) and torch.equal(again.val[0], good_val)


def test_upper_case_bin_suffixes_are_shards(tmp_path):
    _handmade_shard(tmp_path / "train.BIN", list(range(200)) * 3)
    loaded = data.load_data(tmp_path / "train.BIN")
    assert loaded.bytes_per_token is None and loaded.largest_token == 199
    assert data.load_data(tmp_path).num_tokens("train") == loaded.num_tokens("train")


def test_the_digest_of_a_large_piece_samples_it_and_still_sees_its_ends():
    big = torch.zeros(3 << 20, dtype=torch.uint8)
    dataset = data.Dataset([big], [big[:100]], 256, 1.0, "test")
    whole = dataset.digest()
    assert dataset.digest(whole_up_to=1 << 20) != whole  # sampled, not hashed whole
    sampled = dataset.digest(whole_up_to=1 << 20)
    for where in (0, len(big) - 1):
        changed = big.clone()
        changed[where] = 1
        other = data.Dataset([changed], [big[:100]], 256, 1.0, "test")
        assert other.digest() != whole and other.digest(whole_up_to=1 << 20) != sampled
