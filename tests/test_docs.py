"""The docs and results/ stay consistent: links resolve, every results path the docs name exists,
every file under results/ is in results/README.md's index, and each index row is cited where it
says. These break silently when a measurement is replaced or a doc is edited."""
import fnmatch
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted("docs/" + f for f in os.listdir(os.path.join(ROOT, "docs"))
                              if f.endswith(".md")) + ["results/README.md"]
README_LIMIT = 12_000  # characters: the README is a user's page, the detail lives in docs/


def _read(rel):
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def _exists(rel):
    return os.path.exists(os.path.join(ROOT, rel))


def _anchor(heading):
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _expand(path):
    """`a.{md,json}` -> [a.md, a.json]."""
    m = re.match(r"(.*)\{(.*)\}(.*)", path)
    return [m.group(1) + x + m.group(3) for x in m.group(2).split(",")] if m else [path]


def _results_files():
    out = []
    for d, dirs, files in os.walk(os.path.join(ROOT, "results")):
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        out += [os.path.relpath(os.path.join(d, f), ROOT).replace(os.sep, "/") for f in files]
    return sorted(f for f in out if f != "results/README.md")


def _index_rows():
    """results/README.md's table: (the row's entries as written, docs it says cite them)."""
    rows = []
    for line in _read("results/README.md").splitlines():
        if line.startswith("| `"):
            cells = line.split("|")
            rows.append((re.findall(r"`([^`]+)`", cells[1]), re.findall(r"README\.md|docs/\w+\.md", cells[3])))
    return rows


def _index_patterns():
    return ["results/" + p for entries, _ in _index_rows() for e in entries for p in _expand(e)]


def _matches(path, pattern):
    return path == pattern or fnmatch.fnmatch(path, pattern) or (pattern.endswith("/") and path.startswith(pattern))


@pytest.mark.parametrize("doc", DOCS)
def test_links_resolve(doc):
    text = _read(doc)
    for link in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"https?:|mailto:", link):
            continue
        path, _, anchor = link.partition("#")
        target = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
        assert _exists(target), f"{doc}: link to {link}, but {target} does not exist"
        if anchor and target.endswith(".md"):
            headings = {_anchor(h) for h in re.findall(r"^#+ (.*)$", _read(target), re.M)}
            assert anchor in headings, f"{doc}: link to {link}, but {target} has no such heading"


@pytest.mark.parametrize("doc", DOCS)
def test_results_paths_exist(doc):
    text = _read(doc)
    for m in re.finditer(r"results/[\w./{},*-]+", text):
        path = m.group(0).rstrip(".,)")
        if re.search(r"[0-9a-f]{7}'s `$", text[max(0, m.start() - 12):m.start()]):
            continue  # "<commit>'s `results/...`": a file in git history, named as such
        for p in _expand(path):
            if "*" not in p and not p.endswith("/"):
                assert _exists(p), f"{doc} names {p}, which does not exist (replaced or moved?)"


def test_every_results_file_is_indexed():
    patterns = _index_patterns()
    unlisted = [f for f in _results_files() if not any(_matches(f, p) for p in patterns)]
    assert not unlisted, f"results/README.md does not list {unlisted}"
    stale = [p for p in patterns if not any(_matches(f, p) for f in _results_files())]
    assert not stale, f"results/README.md lists {stale}, which match no file"


def test_index_rows_are_cited_where_they_say():
    for entries, cited in _index_rows():  # an entry's name: its stem (a.{md,json}, a.*: a)
        assert cited, f"results/README.md: no citing doc given for {entries}"
        names = [os.path.basename(re.split(r"[*{]", e)[0].rstrip("/.")) for e in entries]
        texts = {doc: _read(doc) for doc in cited}
        for name, entry in zip(names, entries):
            assert any(name in t for t in texts.values()), f"results/{entry} is cited in none of {cited}"
        for doc, t in texts.items():
            assert any(name in t for name in names), f"results/README.md says {doc} cites {entries}; it does not"


def test_readme_length():
    n = len(_read("README.md"))
    assert n <= README_LIMIT, f"README.md has {n} characters, over {README_LIMIT}: move detail to docs/"


def test_scripts_write_outside_results_unless_told():
    """results/ holds only the indexed files the docs cite: a script's default output there
    would fail test_every_results_file_is_indexed for whoever ran the documented command."""
    for path in ("analyze.py", "bench_kernels.py", "bench.py", "ablate.py", "scripts/profile_step.py",
                 "scripts/memory_breakdown.py"):
        src = open(os.path.join(ROOT, path)).read()
        assert not re.findall(r"default=[\"']results", src), path


@pytest.mark.parametrize("cmd, out", [
    (["tests/gpu/check_kernels.py", "--help"], "--part=k/n"),
    (["dev/host_overhead.py", "--help"], "--cpu-stub"),
    (["dev/quant_breakdown.py"], "error: quant_breakdown.py times CUDA kernels and needs a CUDA GPU"),
])
def test_gpu_tools_the_docs_cite_answer_on_a_cpu(cmd, out):
    """On a machine without a GPU: their options (help before the skip), or one line, not a
    traceback."""
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    p = subprocess.run([sys.executable] + cmd, cwd=ROOT, capture_output=True, text=True)
    assert out in p.stdout + p.stderr and "Traceback" not in p.stderr, p.stderr
