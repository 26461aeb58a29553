"""Corpus: split by file, deterministic, no test packages."""
from pathlib import Path

from training.corpus import EOT, join_documents, list_source_files, load_corpus, split_files


def test_split_is_by_file_and_deterministic():
    a = load_corpus()
    b = load_corpus()
    assert a.train_files == b.train_files and a.heldout_files == b.heldout_files
    assert set(a.train_files).isdisjoint(a.heldout_files)
    assert len(a.heldout_files) >= 10 and len(a.train_files) > 10 * len(a.heldout_files)
    # the split does not depend on the order the files were listed in
    files = list(a.train_files + a.heldout_files)
    assert split_files(files[::-1]) == (list(a.train_files), list(a.heldout_files))


def test_excludes_tests_and_site_packages():
    files = list_source_files(load_corpus().root)
    for f in files:
        parts = Path(f).parts
        assert not {"test", "tests", "idle_test", "site-packages", "__pycache__"} & set(parts), f
        assert f.endswith(".py") and not Path(f).name.startswith("_sysconfigdata")
    assert "pydoc_data/topics.py" not in files


def test_split_files_small_example():
    tr, he = split_files(["c.py", "a.py", "b.py"], heldout_fraction=1 / 3, seed=0)
    assert len(he) == 1 and sorted(tr + he) == ["a.py", "b.py", "c.py"]
    assert join_documents(["x", "y"]) == f"x{EOT}y{EOT}"
