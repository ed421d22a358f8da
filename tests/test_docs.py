"""The documentation holds together: method citations point to sections that exist, relative links
resolve, the results tables match their evaluation files, and the README stays short.

Pure text checks over the repository (no model, no torch): part of the fast loop.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from helpers import load_script

ROOT = Path(__file__).resolve().parents[1]
METHOD = ROOT / "docs" / "method.md"
# folders that are not the project's own text
SKIP_DIRS = {".git", ".venv", "venv", "node_modules", "build", "dist", "__pycache__", ".ruff_cache", ".pytest_cache"}
TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".txt", ".cfg"}
CITATION = re.compile(r"docs/method\.md\s*§\s*(\d+(?:\.\d+)?)")
# assembled so that this file does not cite what it forbids
OLD_SPEC = re.compile(r"\b" + "SPEC" + r"(?:\.md|\s*§)")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
MAX_README_LINES = 150


def project_files(root: Path = ROOT, suffixes: set[str] = TEXT_SUFFIXES) -> list[Path]:
    """Every text file of the project under ``root`` (virtual environments, caches and builds left out)."""
    found = []
    for path in root.rglob("*"):
        rel = path.relative_to(root).parts
        if any(part in SKIP_DIRS or part.endswith(".egg-info") for part in rel[:-1]):
            continue
        if path.is_file() and path.suffix in suffixes:
            found.append(path)
    return sorted(found)


def method_sections(text: str) -> set[str]:
    """Section numbers of the method page: ``## N. Title`` gives ``"N"``, ``### N.M Title`` gives ``"N.M"``."""
    sections = set(re.findall(r"^## (\d+)\. ", text, flags=re.MULTILINE))
    sections |= set(re.findall(r"^### (\d+\.\d+)\.? ", text, flags=re.MULTILINE))
    return sections


def missing_citations(files: list[Path], sections: set[str], root: Path = ROOT) -> list[str]:
    """``"path:line: §N"`` for every ``docs/method.md §N`` citation whose section is not in ``sections``."""
    bad = []
    for path in files:
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            for cited in CITATION.findall(line):
                if cited not in sections:
                    bad.append(f"{path.relative_to(root)}:{number}: §{cited}")
    return bad


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors of a markdown page's headings (lower case, punctuation dropped, spaces to
    hyphens; a repeated heading gets ``-1``, ``-2``, ...). Headings inside code blocks are not headings."""
    anchors: set[str] = set()
    counts: dict[str, int] = {}
    in_code = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        match = re.match(r"^#{1,6} (.+?)\s*#*\s*$", line)
        if in_code or not match:
            continue
        title = re.sub(r"`|\*\*|\*", "", match.group(1)).strip().lower()
        slug = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
        n = counts.get(slug, 0)
        counts[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """Relative links (and images) of a markdown page that point to no file, or to no heading of it."""
    text = page.read_text(encoding="utf-8")
    text_outside_code = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    bad = []
    for target in LINK.findall(text_outside_code):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            bad.append(f"{page.relative_to(root)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest.read_text(encoding="utf-8")):
            bad.append(f"{page.relative_to(root)}: {target} (no such heading)")
    return bad


def doc_pages(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", root / "bench" / "README.md", *sorted((root / "docs").glob("*.md"))]


# -- method citations -----------------------------------------------------------------------------

def test_method_page_has_the_ten_sections():
    sections = method_sections(METHOD.read_text(encoding="utf-8"))
    assert {str(n) for n in range(1, 11)} <= sections


def test_every_cited_method_section_exists():
    sections = method_sections(METHOD.read_text(encoding="utf-8"))
    files = project_files()
    assert any(CITATION.search(p.read_text(encoding="utf-8", errors="replace")) for p in files if p.suffix == ".py")
    assert missing_citations(files, sections) == []


def test_a_citation_of_a_missing_section_is_reported(tmp_path):
    cite = "docs/method.md §"  # assembled, so that this file cites no missing section itself
    (tmp_path / "mod.py").write_text(f'"""See {cite}2 and {cite}4.1."""\n'
                                     f"# {cite}11 does not exist, nor {cite}2.9\n")
    found = missing_citations(project_files(tmp_path), {"2", "4", "4.1"}, root=tmp_path)
    assert found == ["mod.py:2: §11", "mod.py:2: §2.9"]


def test_method_sections_reads_both_heading_levels():
    text = "# The method\n## 1. One\n### 1.1 Sub\n## 10. Ten\n### 2.3. Dotted\n## Not numbered\n"
    assert method_sections(text) == {"1", "1.1", "10", "2.3"}


def test_no_file_cites_the_old_spec():
    offenders = []
    for path in project_files():
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if OLD_SPEC.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:80]}")
    assert offenders == [], "cite docs/method.md §N instead:\n" + "\n".join(offenders)


# -- links ----------------------------------------------------------------------------------------

def test_relative_links_in_readme_and_docs_resolve():
    bad = [entry for page in doc_pages() for entry in broken_links(page)]
    assert bad == []


def test_broken_links_are_reported(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## A section (with `code`)\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md) [ok](other.md#a-section-with-code) [self](#page) [web](https://x.org/y)\n"
                    "[gone](missing.md) [no heading](other.md#nope) ![img](pic.png)\n\n# Page\n"
                    "```\n[in code](not-checked.md)\n```\n")
    assert broken_links(page, root=tmp_path) == ["page.md: missing.md (no such file)",
                                                 "page.md: other.md#nope (no such heading)",
                                                 "page.md: pic.png (no such file)"]


def test_heading_anchors_follow_github():
    text = "## 7. Interventions (edits along a lens's read directions)\n## 8. pass@k protocol\n## Setup\n## Setup\n"
    assert heading_anchors(text) == {"7-interventions-edits-along-a-lenss-read-directions", "8-passk-protocol",
                                     "setup", "setup-1"}


def test_every_docs_page_is_listed_in_the_index():
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    listed = {Path(target.partition("#")[0]).name for target in LINK.findall(index)}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"index.md"}
    assert pages <= listed


# -- the README -----------------------------------------------------------------------------------

def test_readme_is_short_and_starts_with_the_two_commands():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES
    block = lines[lines.index("```bash") + 1:lines.index("```")]
    assert [line.split("#")[0].strip() for line in block] == ["bash run.sh app", "bash run.sh test"]
    assert lines.index("```bash") < 5


# -- the results tables ---------------------------------------------------------------------------

def _readme_tables():
    return load_script("scripts/readme_tables.py")


def test_results_page_holds_the_tables_of_the_shipped_evaluation():
    rt = _readme_tables()
    found, _ = rt.tables(ROOT / "assets" / "lenses" / "smollm2-135m.eval")
    page = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    assert {"per_layer", "pass_at_k", "swap"} <= set(found) <= {"per_layer", "pass_at_k", "swap", "lens_comparison", "ablation",
                                                              "ablation_steps", "across_sets", "decoys",
                                                              "across_sets_decoys"}
    assert rt.write_tables.__doc__
    for name, body in found.items():
        assert rt.replace_between_markers(page, name, body) == page, f"docs/results.md's {name} table is stale"


def test_lens_comparison_table_rows_are_macro_comparison_numbers(tmp_path):
    import shutil

    import pandas as pd

    from jlens_core.evaluation.lens_comparison import macro_comparison

    rt = _readme_tables()
    folder = tmp_path / "eval"
    shutil.copytree(ROOT / "assets" / "lenses" / "smollm2-135m.eval", folder)
    detail = pd.read_csv(folder / "pass_at_k_detail.csv")
    detail = detail[detail["lens"].isin(["logit", "jacobian"])]
    detail.to_csv(folder / "pass_at_k_detail.csv", index=False)
    (folder / "word").mkdir(exist_ok=True)
    word = detail.assign(vocab="word", best_rank=(detail["best_rank"] // 2).clip(lower=1))
    word.to_csv(folder / "word" / "pass_at_k_detail.csv", index=False)
    found, summaries = rt.tables(folder)
    rows = [line for line in found["lens_comparison"].splitlines()[2:]]
    assert len(rows) == 4 and any("comparison: 9 sets" in s for s in summaries)
    expected = macro_comparison(pd.concat([detail, word]), 10, n_boot=2000).set_index(["lens", "vocab"])
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        key = ({"logit": "logit", "Jacobian": "jacobian"}[cells[0]], cells[1])
        assert cells[4].startswith(f"{expected.loc[key, 'macro']:.3f} (")
        assert cells[7] == expected.loc[key, "verdict"]


def _macro_at_10(frame) -> float:
    """Macro pass@10 by hand: the mean over sets of the mean over items of the fraction of scored intermediates
    found at rank <= 10."""
    inter = frame[(frame["role"] == "intermediate") & frame["scored"]]
    per_item = inter.assign(hit=inter["best_rank"] <= 10).groupby(["set", "item"])["hit"].mean()
    return float(per_item.groupby(level="set").mean().mean())


def test_ablation_steps_are_paired_differences_along_each_path():
    import pandas as pd

    rt = _readme_tables()
    detail = pd.read_csv(ROOT / "assets" / "lenses" / "smollm2-135m.eval" / "pass_at_k_detail.csv")
    j = detail[detail["lens"] == "jacobian"].assign(vocab="all")
    ranks = j["best_rank"].to_numpy()
    variants = {("relevance", "all"): ranks + 3, ("relevance-experts", "all"): ranks + 1,
                ("relevance++", "all"): (ranks // 2).clip(1), ("relevance++", "word"): (ranks // 3).clip(1)}
    frames = [j] + [j.assign(lens=lens, vocab=vocab, best_rank=r) for (lens, vocab), r in variants.items()]
    table = rt.ablation_steps_table(pd.concat(frames, ignore_index=True), n_boot=200)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]
    assert [r[1] for r in rows] == ["relevance rules", "experts, uniform weights", "learned weights", "word readout",
                                    "**all steps**"]  # the J++ path is left out: its lenses are missing
    macros = [_macro_at_10(j)] + [_macro_at_10(f) for f in frames[1:]]
    for row, before, after in zip(rows, macros, macros[1:]):
        assert row[4] == f"{after:.3f}" and row[5].startswith(f"{after - before:+.3f} (")
    assert rows[-1][5].startswith(f"{macros[-1] - macros[0]:+.3f} (") and rows[-1][5].endswith("vs the J lens")


def test_across_sets_rows_are_each_lens_macro_against_the_j_lens():
    import pandas as pd

    rt = _readme_tables()
    detail = pd.read_csv(ROOT / "assets" / "lenses" / "smollm2-135m.eval" / "pass_at_k_detail.csv")
    j = detail[detail["lens"] == "jacobian"].assign(vocab="all")
    other = j.assign(lens="relevance++ (other sets)", best_rank=(j["best_rank"] // 2).clip(1))
    table = rt.across_sets_table({"rexp": pd.concat([j, other], ignore_index=True)}, n_boot=200)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]
    assert [r[:2] for r in rows] == [["rexp", "jacobian"], ["rexp", "relevance++ (other sets)"]]
    assert rows[0][4].startswith(f"{_macro_at_10(j):.3f} (") and rows[0][7] == "baseline"
    assert rows[1][4].startswith(f"{_macro_at_10(other):.3f} (")
    assert rows[1][5].startswith(f"{_macro_at_10(other) - _macro_at_10(j):+.3f} (") and rows[1][7] == "win"


def test_decoy_rows_are_real_and_decoy_macros_and_their_difference():
    import pandas as pd

    rt = _readme_tables()
    detail = pd.read_csv(ROOT / "assets" / "lenses" / "smollm2-135m.eval" / "pass_at_k_detail.csv")
    real = detail[detail["lens"].isin(["logit", "jacobian"])]
    decoy = real.assign(best_rank=real["best_rank"] * 3)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in rt.decoy_table(real, decoy, n_boot=200).splitlines()[2:]]
    assert [r[0] for r in rows] == ["logit", "Jacobian"]
    for row, lens in zip(rows, ["logit", "jacobian"]):
        mine, theirs = _macro_at_10(real[real["lens"] == lens]), _macro_at_10(decoy[decoy["lens"] == lens])
        assert row[1:3] == [f"{mine:.3f}", f"{theirs:.3f}"] and row[3].startswith(f"{mine - theirs:+.3f} (")
    # the last column: each gap minus the J lens's (the same items score all four, so the macros subtract)
    gap = {lens: _macro_at_10(real[real["lens"] == lens]) - _macro_at_10(decoy[decoy["lens"] == lens])
           for lens in ["logit", "jacobian"]}
    assert rows[1][4] == "baseline" and rows[0][4].startswith(f"{gap['logit'] - gap['jacobian']:+.3f} (")


def test_across_sets_decoy_rows_are_each_stacks_gaps_against_the_j_lens():
    import pandas as pd

    rt = _readme_tables()
    detail = pd.read_csv(ROOT / "assets" / "lenses" / "smollm2-135m.eval" / "pass_at_k_detail.csv")
    j = detail[detail["lens"] == "jacobian"].assign(vocab="all")
    other = j.assign(lens="jacobian++ (other sets)", best_rank=(j["best_rank"] // 2).clip(1))
    real = pd.concat([j, other], ignore_index=True)
    decoy = real.assign(best_rank=real["best_rank"] * 4)
    table = rt.across_sets_decoy_table({"jexp": real}, {"jexp": decoy}, n_boot=200)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]
    assert [r[:2] for r in rows] == [["jexp", "jacobian"], ["jexp", "jacobian++ (other sets)"]]
    gap = {}
    for row, frame, fake in ((rows[0], j, decoy[decoy["lens"] == "jacobian"]), (rows[1], other, decoy[decoy["lens"] != "jacobian"])):
        mine, theirs = _macro_at_10(frame), _macro_at_10(fake)
        gap[row[1]] = mine - theirs
        assert row[2:4] == [f"{mine:.3f}", f"{theirs:.3f}"] and row[4].startswith(f"{mine - theirs:+.3f} (")
    assert rows[0][5] == rows[0][6] == "baseline"
    assert rows[1][5].startswith(f"{gap['jacobian++ (other sets)'] - gap['jacobian']:+.3f} (")


def test_readme_tables_rewrites_only_between_markers(tmp_path):
    rt = _readme_tables()
    page = tmp_path / "results.md"
    page.write_text("intro\n<!-- readme_tables:swap -->\n| old |\n<!-- /readme_tables:swap -->\noutro\n")
    rt.write_tables(page, {"swap": "| new |\n| --- |"})
    assert page.read_text() == "intro\n<!-- readme_tables:swap -->\n| new |\n| --- |\n<!-- /readme_tables:swap -->\noutro\n"
    with pytest.raises(ValueError, match="per_layer"):
        rt.write_tables(page, {"swap": "| x |", "per_layer": "| y |"})
    assert "| new |" in page.read_text()  # a missing marker writes nothing
    page.write_text("a\n<!-- readme_tables:per_layer -->\n<!-- /readme_tables:per_layer -->\nb\n")  # new, empty
    rt.write_tables(page, {"per_layer": "| y |"})
    assert page.read_text() == "a\n<!-- readme_tables:per_layer -->\n| y |\n<!-- /readme_tables:per_layer -->\nb\n"


# -- imports shown in the docs ---------------------------------------------------------------------

def _top_level_names(module_file: Path) -> set[str]:
    tree = ast.parse(module_file.read_text(encoding="utf-8"))
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def test_names_the_docs_import_exist():
    """Every ``from jlens_core[.module] import name`` in README.md and docs/ names something that module
    defines or re-exports (read from its source: no torch import)."""
    import jlens_core  # the front door reads its one list of names without importing torch

    front_door = set(jlens_core.__all__)
    missing = []
    for page in doc_pages():
        for module, names in re.findall(r"^from (jlens_core[\w.]*) import ([\w, ]+)", page.read_text(),
                                        re.MULTILINE):
            wanted = {n.strip() for n in names.split(",") if n.strip()}
            if module == "jlens_core":
                have = front_door
            else:
                base = ROOT.joinpath(*module.split("."))
                source = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
                have = _top_level_names(source) if source.is_file() else set()
            missing += [f"{page.relative_to(ROOT)}: {module}.{n}" for n in sorted(wanted - have)]
    assert missing == []
