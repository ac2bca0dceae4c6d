"""The README's "Real signatures" block equals the public functions' signatures, and every relative
link in README.md, docs/*.md and benchmarks/RESULTS.md points to a file (and heading) that exists."""
from __future__ import annotations

import ast
import inspect
import re
import unicodedata
from pathlib import Path

import pytest

import dapo_kernels as dk

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
# Public names of dk.__all__ that are not functions to call: the result / exception types and
# constants the ops return, raise or accept.
NOT_IN_BLOCK = {"GroupFilterResult", "RolloutCorrectionResult", "DynamicSamplingExhausted", "KL_TYPES",
                "LOSS_AGG_MODES", "MoEPermutation"}


def signature_block(text: str) -> str:
    """The body of the first ```python block after the "Real signatures" heading."""
    match = re.search(r"^#+ Real signatures\s*$.*?^```python\n(.*?)^```", text, re.M | re.S)
    assert match, "README.md has no ```python block under a 'Real signatures' heading"
    return match.group(1)


def parse_block(block: str) -> dict[str, str]:
    """``{name: parameter list}`` of each ``dk.name(...)`` entry; an entry may continue on indented
    lines until its parentheses close; what follows the closing parenthesis (``-> ...``) is prose."""
    entries: dict[str, str] = {}
    text = block
    for match in re.finditer(r"^dk\.(\w+)\(", text, re.M):
        name, depth, i = match.group(1), 1, match.end()
        while depth:
            assert i < len(text), f"dk.{name}: unbalanced parentheses in the signature block"
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        assert name not in entries, f"dk.{name} is listed twice"
        entries[name] = " ".join(text[match.end():i - 1].split())
    return entries


def documented_parameters(params: str) -> list[tuple[str, str, object]]:
    """(name, kind, default) of a written parameter list, read as Python (defaults are literals)."""
    args = ast.parse(f"def f({params}): pass").body[0].args
    out = []
    positional = args.posonlyargs + args.args
    defaults = [inspect.Parameter.empty] * (len(positional) - len(args.defaults)) + args.defaults
    for a, d in zip(positional, defaults):
        out.append((a.arg, "POSITIONAL_OR_KEYWORD", d))
    if args.vararg:
        out.append((args.vararg.arg, "VAR_POSITIONAL", inspect.Parameter.empty))
    for a, d in zip(args.kwonlyargs, args.kw_defaults):
        out.append((a.arg, "KEYWORD_ONLY", inspect.Parameter.empty if d is None else d))
    if args.kwarg:
        out.append((args.kwarg.arg, "VAR_KEYWORD", inspect.Parameter.empty))
    return [(n, k, d if d is inspect.Parameter.empty else ast.literal_eval(d)) for n, k, d in out]


def real_parameters(fn) -> list[tuple[str, str, object]]:
    sig = inspect.signature(fn)
    kinds = {inspect.Parameter.POSITIONAL_ONLY: "POSITIONAL_OR_KEYWORD"}  # written without "/"
    return [(p.name, kinds.get(p.kind, p.kind.name), p.default) for p in sig.parameters.values()]


def mismatch(name: str, params: str) -> str | None:
    """None if ``dk.name(params)`` is ``dk.name``'s signature (names, order, kinds, defaults)."""
    written, real = documented_parameters(params), real_parameters(getattr(dk, name))
    if written == real:
        return None
    return f"dk.{name}: README has {written}, inspect.signature has {real}"


BLOCK = parse_block(signature_block(README.read_text()))


def test_block_lists_every_public_function():
    """Every public callable of dapo_kernels (dk.__all__ minus result types and constants) has one
    line in the block, and the block names nothing else."""
    public = {n for n in dk.__all__ if n not in NOT_IN_BLOCK}
    assert set(BLOCK) == public, (
        f"missing from README: {sorted(public - set(BLOCK))}; not public: {sorted(set(BLOCK) - public)}")


@pytest.mark.parametrize("name", sorted(BLOCK))
def test_signature_matches(name):
    """The README's parameter list of dk.<name> equals inspect.signature: names, order, kinds, defaults."""
    assert mismatch(name, BLOCK[name]) is None, mismatch(name, BLOCK[name])


@pytest.mark.parametrize("edit", ["rename", "drop", "add", "default", "kind"])
def test_comparison_catches_an_edited_signature(edit):
    """The comparison fails when a parameter is renamed, missing, added, or its default or kind differs."""
    params = BLOCK["varlen_attention"]
    edited = {
        "rename": params.replace("softcap=", "soft_cap="),
        "drop": params.replace(", deterministic=False", ""),
        "add": params + ", block_size=64",
        "default": params.replace("softcap=0.0", "softcap=1.0"),
        "kind": params.replace(", *,", ","),
    }[edit]
    assert edited != params
    assert mismatch("varlen_attention", edited) is not None


# --------------------------------------------------------------------------- links
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than '-' and '_' dropped, spaces to '-'."""
    text = heading.strip().lower().replace("`", "")
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _FENCE.sub("", path.read_text()).splitlines():
        if m := re.match(r"#{1,6} (.*)", line):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def relative_links(path: Path) -> list[str]:
    """Link targets outside code, without a URL scheme."""
    text = _CODE_SPAN.sub("", _FENCE.sub("", path.read_text()))
    return [t for t in _LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


@pytest.mark.parametrize("page", [README, *DOCS, RESULTS], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    """Every relative link (file or folder, and its #heading if any) of the page exists."""
    links = relative_links(page)
    assert page != README or len(links) >= 5, "the README's link parser found almost no links"
    broken = []
    for target in links:
        file_part, _, fragment = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{fragment} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_slug_follows_github():
    """Anchors as GitHub writes them (the README's links into RESULTS.md rely on it)."""
    assert slug("AOT compile, no GPU (`benchmarks/gpu/aot.py`)") == "aot-compile-no-gpu-benchmarksgpuaotpy"
    assert slug("Demo (`make demo`, `make ablation`)") == "demo-make-demo-make-ablation"
