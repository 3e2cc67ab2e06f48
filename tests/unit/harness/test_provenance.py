"""moepass/harness/provenance.py: a result names the commit of the checkout that produced it."""

import re

from moepass.harness import provenance


def test_the_checkout_is_the_folder_holding_pyproject_and_moepass():
    root = provenance.REPO_ROOT
    assert (root / "pyproject.toml").is_file() and (root / "moepass" / "harness" / "provenance.py").is_file()


def test_commit_is_read_from_the_checkout(monkeypatch):
    monkeypatch.delenv("MOEPASS_COMMIT", raising=False)
    git = provenance.git_commit()
    if (provenance.REPO_ROOT / ".git").exists():
        assert re.fullmatch(r"[0-9a-f]{40}", git["commit"]) and git["dirty"] in (True, False)
    else:
        assert git == {"commit": None, "dirty": None}


def test_moepass_commit_names_the_commit_of_a_tree_without_git(monkeypatch):
    monkeypatch.setenv("MOEPASS_COMMIT", "0123abc")
    assert provenance.git_commit() == {"commit": "0123abc", "dirty": None}
