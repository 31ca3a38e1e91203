"""Byte-level text corpus. The default is real text on every machine without a download: the
source of the Python standard library that runs this script. `--data PATH` reads the user's own
text file (or every *.py, *.txt, *.md, *.rst file under a directory)."""
import pathlib
import sysconfig

import torch

TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst"}


def stdlib_files():
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if p.is_file())


def read_corpus(path=None, max_bytes=4_000_000):
    """Return the corpus as a uint8 tensor of at most max_bytes bytes, in a deterministic order."""
    if path is None:
        files = stdlib_files()
    else:
        p = pathlib.Path(path)
        if not p.exists():
            raise FileNotFoundError(f"--data {path}: no such file or directory")
        files = (
            [p]
            if p.is_file()
            else sorted(f for f in p.rglob("*") if f.suffix in TEXT_SUFFIXES and f.is_file())
        )
    chunks, total = [], 0
    for f in files:
        data = f.read_bytes()[: max_bytes - total]
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    corpus = b"".join(chunks)
    if len(corpus) < 1024:
        raise ValueError(
            f"corpus from {path or 'the standard library'} has only {len(corpus)} bytes; "
            "need at least 1024"
        )
    return torch.frombuffer(bytearray(corpus), dtype=torch.uint8)


class ByteBatches:
    """Random windows of the corpus. Batch k of rank r depends only on (seed, r, k), so each rank
    draws its own stream and a resumed run sees the batches an uninterrupted one would."""

    def __init__(self, corpus, seq_len, batch_size, seed=0, rank=0, holdout=0.05, step=0):
        split = int(len(corpus) * (1 - holdout))
        self.train, self.valid = corpus[:split], corpus[split:]
        self.seq_len, self.batch_size = seq_len, batch_size
        self.seed, self.rank, self.step = seed, rank, step

    def _windows(self, data, generator):
        starts = torch.randint(
            0, len(data) - self.seq_len - 1, (self.batch_size,), generator=generator
        )
        idx = starts[:, None] + torch.arange(self.seq_len + 1)
        w = data[idx].long()
        return w[:, :-1], w[:, 1:]

    def next(self):
        generator = torch.Generator().manual_seed(
            (self.seed * 1_000_003 + self.rank) * 1_000_003 + self.step
        )
        self.step += 1
        return self._windows(self.train, generator)

    def validation(self, seed=1234):
        return self._windows(self.valid, torch.Generator().manual_seed(seed))
