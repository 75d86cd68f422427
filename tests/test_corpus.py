"""data/corpus.txt is exactly what tools/make_corpus.py generates, and is a
plain-ASCII text of about 300 KB."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "data", "corpus.txt")


def test_corpus_is_regenerated_identically(tmp_path):
    out = tmp_path / "corpus.txt"
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "make_corpus.py"), "--out", str(out)],
                   check=True, capture_output=True)
    with open(CORPUS, "rb") as f:
        assert out.read_bytes() == f.read(), "data/corpus.txt is stale: rerun tools/make_corpus.py"


def test_corpus_is_ascii_text_of_the_right_size():
    with open(CORPUS, "rb") as f:
        data = f.read()
    assert 290_000 <= len(data) <= 320_000, len(data)
    assert all(b == 10 or 32 <= b < 127 for b in data), "non-printable or non-ASCII bytes"
    assert data.endswith(b"\n")
    assert len(set(data)) < 64  # a small alphabet: the byte-level model sees few distinct tokens
