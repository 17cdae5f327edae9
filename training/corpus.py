"""The training corpus: the Python standard library's own .py files, split by file.

Every machine has a stdlib, so nothing is downloaded. Files are named by their path relative to the
stdlib root (posix form), which is the same on every machine and Python version. The held-out and
drafter-only parts are FIXED lists in this folder (heldout_files.txt, drafter_files.txt); every other
.py file found on the machine is target-train. A listed file that a machine lacks is skipped, so the
split stays the same where the files exist (Python 3.11 on the CPU machines, 3.12 on the GPU machine).

    python -m training.corpus               # print the split found on this machine
    python -m training.corpus --write-lists --also-stdlib /path/to/python3.12 ...   # regenerate the lists
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import pathlib
import sysconfig

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
HELDOUT_LIST = HERE / "heldout_files.txt"
DRAFTER_LIST = HERE / "drafter_files.txt"
EOS = "<|endoftext|>"
MASK = "<|mask|>"
MAX_FILE_BYTES = 512_000  # pydoc_data/topics.py (a docs dump) is the only stdlib file above this

# Never put in the fixed lists: Debian/Ubuntu ship these in separate packages (tests, idle, tk), or
# they were removed in 3.12/3.13, or they are data tables rather than code.
_NOT_LISTABLE_TOP = {"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "distutils", "ensurepip",
                     "pydoc_data", "encodings", "site-packages", "dist-packages", "__phello__"}


def stdlib_root() -> pathlib.Path:
    """This interpreter's stdlib, or $PDFLASH_STDLIB: Debian/Ubuntu system Pythons ship the test suite
    (about 60% of the stdlib's code) in a separate package, so point this at a full stdlib there."""
    return pathlib.Path(os.environ.get("PDFLASH_STDLIB") or sysconfig.get_paths()["stdlib"])


def find_files(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Relative posix path -> file, for every readable stdlib .py file (no site-packages)."""
    out = {}
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if rel.split("/")[0] in ("site-packages", "dist-packages") or not p.is_file():
            continue
        if p.stat().st_size > MAX_FILE_BYTES:
            continue
        out[rel] = p
    return out


def read_text(path: pathlib.Path) -> str | None:
    """The file's text, or None if it is not valid UTF-8 (a few test files are deliberately not)."""
    try:
        return path.read_bytes().decode("utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def read_list(path: pathlib.Path) -> list[str]:
    return [l.strip() for l in path.read_text().splitlines() if l.strip() and not l.startswith("#")]


@dataclasses.dataclass
class Split:
    root: pathlib.Path
    train: list[str]
    drafter: list[str]
    heldout: list[str]

    def texts(self, part: str) -> list[str]:
        out = []
        for rel in getattr(self, part):
            t = read_text(self.root / rel)
            if t is not None and t.strip():
                out.append(t)
        return out

    def summary(self) -> dict:
        def size(rels):
            return sum((self.root / r).stat().st_size for r in rels)

        return {
            "stdlib": str(self.root),
            **{f"{part}_files": len(getattr(self, part)) for part in ("train", "drafter", "heldout")},
            **{f"{part}_bytes": size(getattr(self, part)) for part in ("train", "drafter", "heldout")},
        }


def load_split(root: pathlib.Path | None = None, max_files: int | None = None) -> Split:
    """The split on this machine: listed files that exist, and target-train = all the others.

    `max_files` (smoke runs) keeps at most that many files of each part: for target-train a
    deterministic sample spread over the library, for the fixed lists their first entries.
    """
    root = root or stdlib_root()
    files = find_files(root)
    heldout = [r for r in read_list(HELDOUT_LIST) if r in files]
    drafter = [r for r in read_list(DRAFTER_LIST) if r in files]
    fixed = set(read_list(HELDOUT_LIST)) | set(read_list(DRAFTER_LIST))
    train = [r for r in files if r not in fixed]
    if max_files is not None:
        train, drafter, heldout = sorted(train, key=_hash)[:max_files], drafter[:max_files], heldout[:max_files]
    elif not (root / "test").is_dir():
        print(f"WARNING: {root} has no test/ folder (a Debian/Ubuntu system Python?): target-train is about a third "
              "of the usual size; set PDFLASH_STDLIB to a full stdlib (see training/README.md)")
    return Split(root, train, drafter, heldout)


def _hash(rel: str) -> str:
    return hashlib.sha1(rel.encode()).hexdigest()


def write_lists(roots: list[pathlib.Path], heldout_bytes: int, drafter_bytes: int) -> None:
    """Choose the fixed lists among files present in every given stdlib, in sha1(path) order."""
    found = [find_files(r) for r in roots]
    common = set(found[0]).intersection(*found[1:])
    eligible = sorted(
        (r for r in common if r.split("/")[0] not in _NOT_LISTABLE_TOP and "test" not in r.split("/")[-1]
         and read_text(found[0][r]) is not None and found[0][r].stat().st_size >= 1000),
        key=_hash,
    )
    parts: dict[str, list[str]] = {"heldout": [], "drafter": []}
    quota = {"heldout": heldout_bytes, "drafter": drafter_bytes}
    it = iter(eligible)
    for part in ("heldout", "drafter"):
        total = 0
        for rel in it:
            parts[part].append(rel)
            total += found[0][rel].stat().st_size
            if total >= quota[part]:
                break
    header = ("# Fixed {} files: paths relative to the stdlib root (sysconfig stdlib), chosen by\n"
              "# `python -m training.corpus --write-lists` among files present in Python {}. Do not edit by hand.\n")
    versions = ", ".join(r.name for r in roots)
    HELDOUT_LIST.write_text(header.format("held-out", versions) + "\n".join(sorted(parts["heldout"])) + "\n")
    DRAFTER_LIST.write_text(header.format("drafter-only", versions) + "\n".join(sorted(parts["drafter"])) + "\n")


# ---- token streams ---------------------------------------------------------------------------------

def encode_docs(tokenizer, texts: list[str]) -> list[np.ndarray]:
    """One int32 array per document, each ending with the end-of-text token."""
    eos = tokenizer.convert_tokens_to_ids(EOS)
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    return [np.asarray(list(x) + [eos], dtype=np.int32) for x in ids]


def concat(docs: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(docs) if docs else np.zeros(0, dtype=np.int32)


def prompt_windows(docs: list[np.ndarray], prompt_len: int, tail_len: int, count: int, seed: int) -> np.ndarray:
    """`count` prompts of `prompt_len` tokens, each from a document with at least `tail_len` tokens after it.

    Deterministic; spreads over documents (round robin over a seeded order) so no file dominates.
    """
    rng = np.random.default_rng(seed)
    need = prompt_len + tail_len
    usable = [d[:-1] for d in docs if len(d) - 1 >= need]  # drop the trailing end-of-text
    if not usable:
        raise ValueError(f"no document has {need} tokens")
    order = rng.permutation(len(usable))
    out = []
    i = 0
    while len(out) < count:
        d = usable[order[i % len(usable)]]
        start = int(rng.integers(0, len(d) - need + 1))
        out.append(d[start : start + prompt_len])
        i += 1
    return np.stack(out).astype(np.int64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write-lists", action="store_true", help="regenerate heldout_files.txt and drafter_files.txt")
    ap.add_argument("--also-stdlib", action="append", default=[], help="other stdlib roots the listed files must exist in")
    ap.add_argument("--heldout-bytes", type=int, default=1_700_000)
    ap.add_argument("--drafter-bytes", type=int, default=1_900_000)
    args = ap.parse_args()
    if args.write_lists:
        write_lists([stdlib_root()] + [pathlib.Path(p) for p in args.also_stdlib], args.heldout_bytes, args.drafter_bytes)
    for k, v in load_split().summary().items():
        print(f"{k:>16}: {v}")


if __name__ == "__main__":
    main()
