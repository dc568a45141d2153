"""Token data for `orthoptim train`: the built-in corpus and the readers behind ``--data``.

Every source ends up as train and validation lists of 1-D token tensors (one per file or shard) plus
a vocabulary size.
Batches are random windows drawn from a generator seeded by (seed, step), so every optimizer of a
comparison sees the same batches and a resumed run continues with the batches it would have seen.

Built-in corpus: the standard library's own ``.py`` files (present wherever CPython runs), byte
tokens (vocabulary 256). Files are listed and sorted by path, a fixed-size sample is chosen by a hash
of each path, and one file in ten (also by hash) goes to validation, so validation text comes from
files the model never trains on. The result is cached as two ``.bin`` shards (the same format as
``--data``), keyed by the Python version that supplied the text.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from orthoptim.train.results import atomic_write_bytes

# The .bin shard format of the public GPT speed-run data: 256 int32 header words, then uint16 tokens,
# little-endian (read and written in the machine's byte order, which is little-endian on x86 and ARM).
SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_WORDS = 256
HEADER_BYTES = HEADER_WORDS * 4

CORPUS_VERSION = 1  # bump when the builder changes what it produces
CORPUS_CAP_BYTES = 4 * 1024 * 1024  # the default run reads a third of it (1.2 M tokens); builds in < 1 s
VAL_ONE_IN = 10  # one file in ten goes to validation
# A text folder whose files held out by that rule are more than this share of its bytes (a few files
# of uneven size) holds out the end of its text instead.
MAX_VAL_SHARE = 0.25
# Directories of the standard library left out: tests (odd, generated content), vendored packages,
# and the codec tables of `encodings` (long runs of escaped characters, not code).
SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "encodings", "site-packages", "dist-packages", "__pycache__"}
TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".c", ".h", ".json", ".html", ".tex", ".csv", ".js", ".yaml", ".yml"}


class DataError(ValueError):
    """Bad or missing data: the message says which file and what is wrong."""


@dataclass
class Dataset:
    train: list[Tensor]  # 1-D token tensors (uint8 bytes or uint16 shard tokens), one per file or shard
    val: list[Tensor]
    vocab_size: int
    bytes_per_token: float | None  # 1.0 for byte-level text; None when unknown (pre-tokenized shards)
    description: str
    largest_token: int | None = None  # the largest id in the pieces the vocabulary was read from (None: not read)

    def set_vocabulary(self, size: int) -> None:
        """``--vocab-size``: ``size`` instead of the vocabulary read from the data, in the description too."""
        read = f", vocabulary {self.vocab_size}"
        if self.description.endswith(read):
            self.description = self.description[: -len(read)]
        self.vocab_size = size
        self.description += f", vocabulary {size} (--vocab-size)"

    def num_tokens(self, split: str) -> int:
        return sum(len(t) for t in (self.train if split == "train" else self.val))

    def digest(self, whole_up_to: int = 64 << 20, samples: int = 64) -> str:
        """SHA-256 of the tokens of both splits, in order: what a resumed run checks it trains on. A
        piece of more than ``whole_up_to`` bytes (a large shard set is not read in full each run) is
        hashed by its length and ``samples`` evenly spaced 1 MiB windows, its first and last included."""
        h = hashlib.sha256()
        for split in (self.train, self.val):
            for t in split:
                h.update(f"{t.dtype}:{len(t)};".encode())
                flat = t.contiguous().numpy()
                if flat.nbytes <= whole_up_to:
                    h.update(memoryview(flat))
                    continue
                window = (1 << 20) // flat.itemsize
                for i in range(samples):
                    start = (len(flat) - window) * i // (samples - 1)
                    h.update(memoryview(flat[start:start + window]))
            h.update(b"|")
        return h.hexdigest()

    def batch(self, split: str, batch_size: int, context: int, seed: int, step: int,
              device: str | torch.device = "cpu", rank: int = 0, world: int = 1) -> tuple[Tensor, Tensor]:
        """Inputs and targets [batch_size / world, context]: this rank's share of ``batch_size`` random
        windows chosen by (seed, split, step) only, so the global batch does not depend on the number
        of processes. A window never crosses from one shard into the next."""
        pieces = [t for t in (self.train if split == "train" else self.val) if len(t) > context]
        starts_per_piece = [len(t) - context for t in pieces]
        gen = torch.Generator().manual_seed(_mix(seed, split, step))
        picks = torch.randint(0, sum(starts_per_piece), (batch_size,), generator=gen).tolist()
        share = batch_size // world
        picks = picks[rank * share:(rank + 1) * share]
        rows = []
        for pick in picks:
            i = 0
            while pick >= starts_per_piece[i]:
                pick -= starts_per_piece[i]
                i += 1
            rows.append(pieces[i][pick:pick + context + 1].to(torch.int64))
        rows = torch.stack(rows)
        if int(rows.max()) >= self.vocab_size:
            raise DataError(f"{self.description}: token {int(rows.max())} is outside the vocabulary of "
                            f"{self.vocab_size}; pass a larger --vocab-size")
        rows = rows.to(device)
        return rows[:, :-1], rows[:, 1:]


def _mix(seed: int, split: str, step: int) -> int:
    digest = hashlib.sha256(f"{seed}/{split}/{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


# ------------------------------------------------------------------------------------ .bin shards
def write_shard(path: str | Path, tokens: Tensor | list[int]) -> None:
    """Write tokens (ints in [0, 65535]) as a .bin shard, atomically."""
    tokens = torch.as_tensor(tokens).to(torch.int64)
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) > 65535):
        raise DataError("shard tokens must lie in [0, 65535] to fit uint16")
    header = torch.zeros(HEADER_WORDS, dtype=torch.int32)
    header[0], header[1], header[2] = SHARD_MAGIC, SHARD_VERSION, tokens.numel()
    atomic_write_bytes(Path(path), _raw_bytes(header) + _raw_bytes(tokens.to(torch.uint16)))


def _raw_bytes(t: Tensor) -> bytearray:
    out = bytearray(t.numel() * t.element_size())
    if t.numel():
        torch.frombuffer(out, dtype=t.dtype).copy_(t.flatten())
    return out


def read_shard(path: str | Path) -> Tensor:
    """The uint16 tokens of a .bin shard (memory-mapped, not copied). Checks magic, version, size."""
    path = Path(path)
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise DataError(f"{path}: {size} bytes is shorter than the {HEADER_BYTES}-byte header of a .bin shard")
    with open(path, "rb") as f:
        header = torch.frombuffer(bytearray(f.read(HEADER_BYTES)), dtype=torch.int32)
    magic, version, count = (int(v) for v in header[:3])
    if magic != SHARD_MAGIC:
        raise DataError(f"{path}: header magic is {magic}, expected {SHARD_MAGIC}; not a .bin token shard")
    if version != SHARD_VERSION:
        raise DataError(f"{path}: shard version {version} is not supported (expected {SHARD_VERSION})")
    expected = HEADER_BYTES + 2 * count
    if size != expected:
        raise DataError(f"{path}: header says {count} tokens ({expected} bytes in all) but the file has {size} "
                        "bytes; the shard is truncated or not uint16")
    if count == 0:
        return torch.zeros(0, dtype=torch.uint16)
    with open(path, "rb") as f:
        # copy-on-write: the tensor is writable (torch wants that) but nothing is ever written to the file
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    return torch.frombuffer(mapped, dtype=torch.uint16, offset=HEADER_BYTES, count=count)


# ------------------------------------------------------------------------------------ text
def _text_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES
                  and not any(part.startswith(".") for part in p.relative_to(folder).parts))


def _path_hash(relative: str) -> int:
    return int.from_bytes(hashlib.sha256(relative.encode()).digest()[:8], "little")


def split_files(files: list[Path], root: Path, cap_bytes: int | None) -> tuple[list[Path], list[Path]]:
    """A deterministic (train, val) split of ``files``: keep files in order of a hash of their path
    until ``cap_bytes`` is reached, then send one in ``VAL_ONE_IN`` (by the same hash) to validation."""
    chosen = files
    if cap_bytes is not None:
        chosen, total = [], 0
        for p in sorted(files, key=lambda p: _path_hash(p.relative_to(root).as_posix())):
            if total >= cap_bytes:
                break
            chosen.append(p)
            total += p.stat().st_size
        chosen.sort()
    val = [p for p in chosen if _path_hash(p.relative_to(root).as_posix()) % VAL_ONE_IN == 0]
    train = [p for p in chosen if p not in set(val)]
    if not val and len(train) > 1:  # tiny folders: still hold one file out
        val = [train.pop()]
    return train, val


def _concat_bytes(files: list[Path]) -> bytes:
    return b"".join(p.read_bytes() + b"\n" for p in files)


def build_corpus(source: Path, out_dir: Path, cap_bytes: int = CORPUS_CAP_BYTES) -> dict:
    """Build train.bin / val.bin (byte tokens) from the ``.py`` files under ``source``; returns its meta."""
    files = []
    for folder, subfolders, names in os.walk(source):
        subfolders[:] = [d for d in subfolders if d not in SKIP_DIRS]  # prune: never walk into site-packages
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    files.sort()
    if not files:
        raise DataError(f"no .py files under {source} to build the built-in corpus from; pass --data PATH")
    train_files, val_files = split_files(files, source, cap_bytes)
    if not train_files or not val_files:
        raise DataError(f"--corpus-mb {cap_bytes / 2**20:g} is too small: the built-in corpus sample holds "
                        f"{len(train_files)} train and {len(val_files)} validation files; pass a larger --corpus-mb")
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"corpus_version": CORPUS_VERSION, "source": str(source), "python": sys.version.split()[0],
            "cap_bytes": cap_bytes, "files": {"train": len(train_files), "val": len(val_files)}}
    for split, chosen in (("train", train_files), ("val", val_files)):
        data = _concat_bytes(chosen)
        write_shard(out_dir / f"{split}.bin", torch.frombuffer(bytearray(data), dtype=torch.uint8))
        meta[f"{split}_tokens"] = len(data)
        meta[f"{split}_sha256"] = hashlib.sha256(data).hexdigest()
    atomic_write_bytes(out_dir / "meta.json", json.dumps(meta, indent=2).encode())
    return meta


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "orthoptim"


def builtin_corpus(cache_dir: str | Path | None = None, source: str | Path | None = None,
                   cap_bytes: int = CORPUS_CAP_BYTES) -> Dataset:
    """The built-in byte corpus, built on first use and read from the cache afterwards."""
    source = Path(source or sysconfig.get_paths()["stdlib"])
    key = f"stdlib-py{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}" \
          f"-v{CORPUS_VERSION}-{cap_bytes}-{hashlib.sha256(str(source).encode()).hexdigest()[:8]}"
    folder = Path(cache_dir or default_cache_dir()) / "corpus" / key
    cached = _read_cached_corpus(folder)
    if cached is None:  # not built yet, or damaged: the cache is derived data, so it is rebuilt
        build_corpus(source, folder, cap_bytes)
        cached = _read_cached_corpus(folder)
        if cached is None:
            raise DataError(f"the built-in corpus in {folder} does not read back as written; check the disk, or "
                            "pass another --cache-dir")
    meta, train, val = cached
    return Dataset([train], [val], 256, 1.0,
                   f"built-in corpus: Python {meta['python']} standard library, {meta['train_tokens']:,} train / "
                   f"{meta['val_tokens']:,} val bytes ({folder})")


def _read_cached_corpus(folder: Path) -> tuple[dict, Tensor, Tensor] | None:
    """meta.json and both shards of a built corpus, each shard checked against the length and SHA-256
    that meta.json records (of the bytes; the shards hold them as uint16 tokens); None if any of it is
    missing, unreadable or different."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        shards = {split: read_shard(folder / f"{split}.bin") for split in ("train", "val")}
    except (OSError, ValueError, DataError):  # JSONDecodeError is a ValueError
        return None
    for split, tokens in shards.items():
        if not isinstance(meta, dict) or len(tokens) != meta.get(f"{split}_tokens") or \
                max_token_id(tokens) > 255 or \
                hashlib.sha256(memoryview(tokens.to(torch.uint8).numpy())).hexdigest() != meta.get(f"{split}_sha256"):
            return None
    return meta, shards["train"], shards["val"]


def load_data(path: str | Path, val_fraction: float = 0.05) -> Dataset:
    """``--data PATH``: a text file, a folder of text files, a .bin shard, or a folder of .bin shards.

    Shards whose file name contains "val" are the validation split; without one, and for a single text
    file, the last ``val_fraction`` of the tokens is held out. A text folder is split by file as the
    built-in corpus is."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"--data {path}: no such file or folder")
    if path.is_dir():
        shards = sorted(f for f in path.iterdir() if f.is_file() and f.suffix.lower() == ".bin")
        if shards:
            return _from_shards(shards, val_fraction, str(path))
        files = _text_files(path)
        if not files:
            raise DataError(f"--data {path}: the folder holds no .bin shards and no text files "
                            f"({', '.join(sorted(TEXT_SUFFIXES))})")
        train_files, val_files = split_files(files, path, None)
        val_bytes = sum(p.stat().st_size for p in val_files)
        if not val_files or not train_files or val_bytes > MAX_VAL_SHARE * sum(p.stat().st_size for p in files):
            # One file, or too few for a split by file (the files held out would be much of the text):
            # hold out the end of the text instead.
            return _from_text(_concat_bytes(files), val_fraction, f"{len(files)} text file(s) in {path}")
        return Dataset([_bytes_tensor(_concat_bytes(train_files))], [_bytes_tensor(_concat_bytes(val_files))],
                       256, 1.0, f"text folder {path}: {len(train_files)} train / {len(val_files)} val files")
    if path.suffix.lower() == ".bin":
        return _from_shards([path], val_fraction, str(path))
    data = path.read_bytes()
    if not data:
        raise DataError(f"--data {path}: the file is empty")
    if b"\0" in data[:4096]:
        raise DataError(f"--data {path}: looks binary (NUL bytes) and is not a .bin shard; pass a text file, "
                        "a folder of text files, or .bin token shards")
    return _from_text(data, val_fraction, f"text file {path}")


def _bytes_tensor(data: bytes) -> Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)


def _from_text(data: bytes, val_fraction: float, description: str) -> Dataset:
    tokens = _bytes_tensor(data)
    cut = len(tokens) - max(1, int(len(tokens) * val_fraction))
    return Dataset([tokens[:cut]], [tokens[cut:]], 256, 1.0,
                   f"{description}: {cut:,} train bytes, last {val_fraction:.0%} held out for validation")


def _from_shards(shards: list[Path], val_fraction: float, where: str) -> Dataset:
    val_paths = [p for p in shards if "val" in p.name]
    train_paths = [p for p in shards if p not in val_paths]
    if not train_paths:
        raise DataError(f"--data {where}: every shard name contains 'val'; no training shards")
    train = [read_shard(p) for p in train_paths]
    if val_paths:
        val = [read_shard(p) for p in val_paths]
        how = f"{len(train_paths)} train / {len(val_paths)} val shard(s)"
    else:
        last = train.pop()
        cut = len(last) - max(1, int(len(last) * val_fraction))
        train.append(last[:cut])
        val = [last[cut:]]
        how = f"{len(train_paths)} shard(s), last {val_fraction:.0%} of the last shard held out for validation"
    # Vocabulary: the largest token id in the first train shard and the val shards (not every shard: a
    # 10B-token set would be read in full), + 1, rounded up to a multiple of 64; --vocab-size overrides.
    top = max(max_token_id(t) for t in [train[0], *val])
    vocab = (top + 1 + 63) // 64 * 64
    return Dataset(train, val, vocab, None, f"token shards {where}: {how}, vocabulary {vocab}", top)


def max_token_id(tokens: Tensor, chunk: int = 1 << 24) -> int:
    """Largest id, read in chunks (uint16 has no max() kernel; a whole shard as int32 would be large)."""
    return max((int(tokens[i:i + chunk].to(torch.int32).max()) for i in range(0, len(tokens), chunk)), default=0)


def check_fits(data: Dataset, context: int) -> None:
    """Each split needs at least one file or shard longer than one window of ``context + 1`` tokens."""
    for split, pieces in (("train", data.train), ("val", data.val)):
        if not any(len(t) > context for t in pieces):
            longest = max((len(t) for t in pieces), default=0)
            raise DataError(f"{data.description}: the {split} split has no piece longer than --context {context} "
                            f"+ 1 tokens (longest: {longest}); use more data or a shorter --context")
