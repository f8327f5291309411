"""Keeps the documentation honest and the repository self-contained: README.md stays short, no
link points outside the repository, every environment variable is declared in rope_ext/envs.py
and listed in docs/packaging.md (and nowhere else read), and the package has no import cycle.

Static checks of the source tree (no build, no torch calls). They need a source checkout: the
copied trees of `make sanitize` and `make torch213-test` carry no docs/ and are skipped."""

import ast
import io
import os
import re
import subprocess
import tokenize

import pytest

from rope_ext import envs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THIS = os.path.relpath(os.path.abspath(__file__), ROOT)

pytestmark = pytest.mark.skipif(
    not os.path.exists(os.path.join(ROOT, ".git")) or not os.path.isdir(os.path.join(ROOT, "docs")),
    reason="not a source checkout (a copied test tree without docs/ or git)",
)

README_MAX_LINES = 200

# Read by the build tools rope_ext drives (setuptools, torch.utils.cpp_extension, CMake), not by
# rope_ext/envs.py; docs/packaging.md lists them in the same table.
STANDARD_VARIABLES = {
    "CUDA_HOME", "CUDA_PATH", "CUDACXX", "TORCH_CUDA_ARCH_LIST", "MAX_JOBS",
    "TORCH_EXTENSIONS_DIR", "CXX",
}

# ROPE_EXT_* names that are not variables rope_ext reads, each with the reason it may appear.
NOT_READ_BY_ROPE_EXT = {
    # Set by a make target for its test run, read by that test only (docs/packaging.md names them).
    "ROPE_EXT_WHEEL": "make wheel-test: the wheel tests/test_wheel.py inspects",
    "ROPE_EXT_EXPECT_INSTALLED": "make torch213-test: the torch version tests/test_wheel.py expects",
    "ROPE_EXT_CMAKE_LIB": "make cmake-test: the library tests/test_cmake_library.py loads",
    "ROPE_EXT_CMAKE_CUDA_LIB": "make cmake-test: the CUDA library tests/test_cmake_library.py loads",
    "ROPE_EXT_AOTI_RUNNER": "make cmake-test: the C++ program tests/test_aoti_deploy.py runs",
    # CMake names: cache options (documented in docs/packaging.md), internal variables and a
    # compile definition of the C++ test; none is an environment variable.
    "ROPE_EXT_BUILD_TESTS": "CMake option: build the C++ dispatcher test",
    "ROPE_EXT_CUDA_LAST_ARCH_ONLY": "CMake option: the CUDA library for one arch (make cmake-test)",
    "ROPE_EXT_WITH_CUDA": "CMakeLists.txt internal variable",
    "ROPE_EXT_NVCC": "CMakeLists.txt internal variable (the nvcc found)",
    "ROPE_EXT_EXPECT_CUDA": "compile definition of tests/cpp/dispatcher_test.cpp",
}

TEXT_SUFFIXES = (".py", ".md", ".txt", ".toml", ".json", ".cpp", ".h", ".cu", ".cuh", ".sh", ".cfg",
                 ".cmake", ".yml", ".yaml")
TEXT_NAMES = ("Makefile", "CMakeLists.txt", ".gitignore", "run")


def repo_files():
    """The repository's files (tracked, or new and not ignored), relative to ROOT."""
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                             capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"git cannot list the repository's files: {e}")
    files = [f for f in out.decode().split("\0") if f]
    return sorted(f for f in files if os.path.isfile(os.path.join(ROOT, f)))


def text_files():
    return [f for f in repo_files()
            if f.endswith(TEXT_SUFFIXES) or os.path.basename(f) in TEXT_NAMES]


def read(rel):
    with open(os.path.join(ROOT, rel), encoding="utf-8", errors="replace") as f:
        return f.read()


def doc_files():
    """README.md and docs/*.md (collected even where the module is skipped: no docs/ there)."""
    docs_dir = os.path.join(ROOT, "docs")
    if not os.path.isdir(docs_dir):
        return ["README.md"]
    return ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(docs_dir)
                                  if f.endswith(".md"))


# ---- README and links ----------------------------------------------------------------------

def test_readme_is_short():
    lines = read("README.md").count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines; at most {README_MAX_LINES}: move details into docs/")


def test_readme_op_table_names_every_op_of_the_schemas():
    """README "The ops" lists each op once, by name; its schema lives in schemas.def alone."""
    from rope_ext._schemas import SCHEMAS

    section = read("README.md").split("## The ops", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `rope::")]
    named = set()
    for row in rows:
        first = row.split("|")[1]
        named.update(name.removeprefix("rope::") for name in re.findall(r"`([^`]+)`", first))
    assert named == set(SCHEMAS), (sorted(set(SCHEMAS) - named), sorted(named - set(SCHEMAS)))


@pytest.mark.parametrize("rel", doc_files())
def test_docs_point_nowhere_outside_the_repository(rel):
    text = read(rel)
    for needle in ("http://", "https://"):
        assert needle not in text, f"{rel} contains {needle!r}: nothing may point outside the repository"


def _python_comments(source):
    """Comments and docstrings of a Python file (string constants that are not docstrings, such
    as torch's own messages repeated verbatim, are not comments)."""
    parts = [tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                parts.append(doc)
    return parts


_CPP_TOKENS = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)


def _cpp_comments(source):
    return [m.group(0) for m in _CPP_TOKENS.finditer(source) if m.group(0).startswith("/")]


def test_comment_finders_skip_strings():
    cpp = 'const char* s = "http://a // b"; // see https://c\n/* d */ char q = \'"\';'
    assert _cpp_comments(cpp) == ["// see https://c", "/* d */"]
    py = '"""Doc."""\nX = "https://a"  # https://b\n'
    assert sorted(_python_comments(py)) == ["# https://b", "Doc."]


def test_code_comments_link_nowhere():
    bad = []
    for f in text_files():
        if not f.startswith(("csrc/", "rope_ext/")):
            continue
        if f.endswith(".py"):
            comments = _python_comments(read(f))
        elif f.endswith((".cpp", ".h", ".cu", ".cuh")):
            comments = _cpp_comments(read(f))
        else:
            continue
        bad += [f"{f}: {c.strip()[:100]}" for c in comments if re.search(r"https?://", c)]
    assert not bad, "comments with links outside the repository:\n" + "\n".join(bad)


_CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)
_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def markdown_links(text):
    """Targets of [text](target) links outside code blocks and code spans."""
    return _LINK.findall(_CODE.sub("", text))


def test_markdown_link_parser_sees_links_and_skips_code():
    text = "a [x](docs/a.md#s) b `[y](no.md)`\n```\n[z](no2.md)\n```\n[w](#here)"
    assert markdown_links(text) == ["docs/a.md#s", "#here"]


@pytest.mark.parametrize("rel", doc_files())
def test_relative_links_resolve(rel):
    bad = []
    for target in markdown_links(read(rel)):
        if target.startswith("#"):
            continue  # an anchor within the page
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            bad.append(f"{target} (points outside the repository)")
            continue
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(ROOT, os.path.dirname(rel), path))
        if not full.startswith(ROOT + os.sep) and full != ROOT:
            bad.append(f"{target} (outside the repository)")
        elif not os.path.exists(full):
            bad.append(f"{target} (no such file)")
        elif anchor and full.endswith(".md") and anchor not in anchors(os.path.relpath(full, ROOT)):
            bad.append(f"{target} (no such section)")
    for target in markdown_links(read(rel)):
        if target.startswith("#") and target[1:] not in anchors(rel):
            bad.append(f"{target} (no such section in this page)")
    assert not bad, f"{rel}: broken links:\n" + "\n".join(bad)


# `docs/math.md "Backward"`, `[models.md](models.md) ("Layout")`, `README "The ops"`: a section
# cited by its title, from code or docs.
_CITATIONS = [
    (re.compile(r'docs/([\w.-]+\.md)\)?,?\s*\(?"([^"\n]+)"'), "docs"),
    (re.compile(r'\]\(([\w.-]+\.md)\),?\s*\(?"([^"\n]+)"'), "relative"),
    (re.compile(r'\bREADME(?:\.md)?,?\s*\(?"([^"\n]+)"'), "readme"),
]


def section_citations():
    """(citing file, cited file, section title) for every section cited by title."""
    found = []
    for f in text_files():
        if f == THIS:
            continue
        text = read(f)
        for pattern, kind in _CITATIONS:
            for m in pattern.finditer(text):
                if kind == "readme":
                    found.append((f, "README.md", m.group(1)))
                elif kind == "docs":
                    found.append((f, os.path.join("docs", m.group(1)), m.group(2)))
                else:
                    cited = os.path.normpath(os.path.join(os.path.dirname(f), m.group(1)))
                    found.append((f, cited, m.group(2)))
    return found


def test_cited_sections_exist():
    citations = section_citations()
    assert any(c[1:] == ("docs/math.md", "Backward") for c in citations)  # the finder works
    bad = []
    for citing, cited, title in citations:
        if not os.path.isfile(os.path.join(ROOT, cited)):
            bad.append(f'{citing}: cites {cited} "{title}", but there is no {cited}')
        elif title.replace("`", "") not in headings(cited):
            bad.append(f'{citing}: cites {cited} "{title}", which has no such section')
    assert not bad, "\n".join(bad)


def _slug(heading):
    """The anchor a Markdown renderer gives a heading: lower case, punctuation dropped, spaces
    to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(rel):
    """The headings of a Markdown file (outside code blocks), code marks removed."""
    text = re.sub(r"```.*?```", "", read(rel), flags=re.S)
    return [h.replace("`", "").strip() for h in re.findall(r"^#+ (.+)$", text, re.M)]


def anchors(rel):
    found, seen = set(), {}
    for h in headings(rel):
        slug = _slug(h)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def test_slugs_follow_the_renderer():
    assert _slug("`rope.apply_` (`rope_ext.apply_rope_`)".replace("`", "")) == "ropeapply_-rope_extapply_rope_"
    assert _slug("Autograd and in-place rules") == "autograd-and-in-place-rules"
    assert _slug("The cos/sin table") == "the-cossin-table"


# ---- environment variables -----------------------------------------------------------------

def _env_table_names():
    text = read(os.path.join("docs", "packaging.md"))
    match = re.search(r"^## Environment variables\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, 'docs/packaging.md has no "## Environment variables" section'
    names = re.findall(r"^\|\s*`([A-Z][A-Z0-9_]*)`\s*\|", match.group(1), re.M)
    assert names, "docs/packaging.md: no table rows of the form | `NAME` | ... under Environment variables"
    assert len(names) == len(set(names)), f"a variable is listed twice: {names}"
    return set(names)


def test_env_table_lists_exactly_the_declared_variables():
    listed = _env_table_names()
    declared = set(envs.VARIABLES)
    assert listed == declared | STANDARD_VARIABLES, (
        f"docs/packaging.md table vs rope_ext/envs.py VARIABLES + standard ones: "
        f"missing {sorted((declared | STANDARD_VARIABLES) - listed)}, "
        f"not declared {sorted(listed - declared - STANDARD_VARIABLES)}")


def test_env_table_states_the_declared_defaults_and_values():
    text = read(os.path.join("docs", "packaging.md"))
    for name, (when, allowed, default, _) in envs.VARIABLES.items():
        row = re.search(rf"^\|\s*`{name}`\s*\|(.*)$", text, re.M).group(1)
        cells = [c.strip() for c in row.split("|")]
        assert cells[0] == when, f"{name}: read at {when!r}, the table says {cells[0]!r}"
        if isinstance(allowed, tuple):
            assert re.findall(r"`([^`]+)`", cells[1]) == list(allowed), f"{name}: values {allowed}"
        if default is not None:
            assert cells[2] == f"`{default}`", f"{name}: default {default!r}, the table says {cells[2]!r}"


# A name directly inside startswith("...") is a prefix, not a variable.
_ROPE_NAME = re.compile(r"(?<![A-Za-z0-9_])ROPE_EXT_[A-Z0-9_]*[A-Z0-9](?![A-Za-z0-9_])")


def _rope_names(text):
    names = set()
    for m in _ROPE_NAME.finditer(text):
        before = text[max(0, m.start() - 12):m.start()]
        after = text[m.end():m.end() + 1]
        if re.search(r"startswith\(['\"]$", before) and after in "'\"":
            continue
        names.add(m.group(0))
    return names


def test_no_other_rope_ext_variable_anywhere():
    known = set(envs.VARIABLES) | set(NOT_READ_BY_ROPE_EXT)
    seen, unknown = set(), []
    for f in text_files():
        if f == THIS:
            continue
        names = _rope_names(read(f))
        seen |= names
        unknown += [f"{f}: {n}" for n in sorted(names - known)]
    assert not unknown, ("ROPE_EXT_* names that rope_ext/envs.py does not declare (declare and "
                         "document them, or remove them):\n" + "\n".join(unknown))
    stale = sorted(set(NOT_READ_BY_ROPE_EXT) - seen)
    assert not stale, f"NOT_READ_BY_ROPE_EXT lists names no file uses any more: {stale}"


def test_rope_name_scanner_skips_prefixes():
    assert _rope_names('k.startswith("ROPE_EXT_CPU") or ROPE_EXT_JIT=1') == {"ROPE_EXT_JIT"}


_ENV_CALLS = {("os", "getenv"), ("os", "putenv"), ("os", "unsetenv"), ("environ", "get"),
              ("environ", "setdefault"), ("environ", "pop")}


def _is_environ(node):
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ")


def _environment_reads(source):
    """(line, key) of each os.environ / os.getenv access; key is the literal name, or None when
    it is computed. A loop variable over a literal tuple (`for var in ("CUDA_HOME", ...)`) counts
    as each of its names."""
    tree = ast.parse(source)
    loop_names = {}
    for node in ast.walk(tree):
        if (isinstance(node, ast.For) and isinstance(node.target, ast.Name)
                and isinstance(node.iter, (ast.Tuple, ast.List))
                and all(isinstance(e, ast.Constant) for e in node.iter.elts)):
            loop_names.setdefault(node.target.id, []).extend(e.value for e in node.iter.elts)
    reads = []
    for node in ast.walk(tree):
        key_node = None
        if isinstance(node, ast.Subscript) and _is_environ(node.value):
            key_node = node.slice
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            owner_name = "environ" if _is_environ(owner) else getattr(owner, "id", None)
            if (owner_name, node.func.attr) in _ENV_CALLS and node.args:
                key_node = node.args[0]
            else:
                continue
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            key_node = node.left
        else:
            continue
        if isinstance(key_node, ast.Constant):
            reads.append((node.lineno, key_node.value))
        elif isinstance(key_node, ast.Name) and key_node.id in loop_names:
            reads += [(node.lineno, k) for k in loop_names[key_node.id]]
        else:
            reads.append((node.lineno, None))
    return reads


def test_only_envs_reads_rope_ext_variables():
    files = [f for f in text_files() if f.endswith(".py") and
             (f.startswith("rope_ext/") or f in ("setup.py", "build_config.py"))]
    bad = []
    for f in files:
        if f == "rope_ext/envs.py":
            continue
        for line, key in _environment_reads(read(f)):
            if key is None:
                bad.append(f"{f}:{line}: environment read with a computed name")
            elif isinstance(key, str) and key.startswith("ROPE_EXT_"):
                bad.append(f"{f}:{line}: reads {key} (read it in rope_ext/envs.py)")
    assert not bad, "\n".join(bad)


def test_environment_read_finder_sees_every_form():
    src = ("import os\nfrom os import environ\n"
           "a = os.environ.get('ROPE_EXT_A')\nb = os.environ['ROPE_EXT_B']\n"
           "c = os.getenv('ROPE_EXT_C')\nd = 'ROPE_EXT_D' in os.environ\ne = environ.get(k)\n"
           "for v in ('ROPE_EXT_F', 'X'):\n    os.environ.get(v)\n")
    assert sorted(_environment_reads(src), key=lambda r: (r[0], str(r[1]))) == [
        (3, "ROPE_EXT_A"), (4, "ROPE_EXT_B"), (5, "ROPE_EXT_C"), (6, "ROPE_EXT_D"), (7, None),
        (9, "ROPE_EXT_F"), (9, "X")]


# ---- import cycles -------------------------------------------------------------------------

def _package_modules():
    """module name -> path, for every module of rope_ext/."""
    modules = {}
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, "rope_ext")):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for name in filenames:
            if not name.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), ROOT)[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            modules[".".join(rel)] = os.path.join(dirpath, name)
    return modules


def import_graph(modules):
    """Edges module -> modules of the package it imports (anywhere in the file, functions
    included). `from P import name` depends on P.name when that is a module, else on P itself;
    a package that is an ancestor of the importer is not a dependency when only its submodules
    are taken from it (it is necessarily being imported already)."""
    graph = {m: set() for m in modules}
    for mod, path in modules.items():
        is_package = path.endswith("__init__.py")
        ancestors = {".".join(mod.split(".")[:i]) for i in range(1, mod.count(".") + 1)}
        if is_package:
            ancestors.add(mod)
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)

        def add(target, explicit):
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                name = ".".join(parts[:i])
                if name not in modules or name == mod:
                    continue
                if name in ancestors and not (explicit and i == len(parts)):
                    continue
                graph[mod].add(name)

        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "rope_ext" or alias.name.startswith("rope_ext."):
                        add(alias.name, explicit=True)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_package else mod.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source != "rope_ext" and not source.startswith("rope_ext."):
                    continue
                add(source, explicit=False)
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    if sub in modules:
                        add(sub, explicit=True)
                    elif source in modules and source != mod:
                        graph[mod].add(source)  # a name defined by the package's own __init__
    return graph


def find_cycle(graph):
    """One cycle as a list of modules (first == last), or None."""
    color, stack = {}, []

    def visit(node):
        color[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if color.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in color:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        color[node] = 2
        return None

    for node in sorted(graph):
        if node not in color:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycle_in_the_package():
    modules = _package_modules()
    assert "rope_ext.ops" in modules and "rope_ext.compat" in modules
    graph = import_graph(modules)
    assert "rope_ext._checks" in graph["rope_ext.reference"]  # the graph sees relative imports
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_family_modules_keep_their_former_names():
    """The op families' Python modules moved into folders (rope_ext/_qk_norm/, _quant/,
    _kv_shift/); code that imported them by their former top-level names gets the same modules."""
    import importlib

    import rope_ext
    from rope_ext._kv_shift import reference as kv_shift_reference
    from rope_ext._qk_norm import checks, reference, registrations
    from rope_ext._quant import checks as quant_checks, registrations as quant_registrations

    former = {"_kv_shift_reference": kv_shift_reference, "_qk_norm_checks": checks,
              "_qk_norm_reference": reference, "_qk_norm_registrations": registrations,
              "_quant_checks": quant_checks, "_quant_ops": quant_registrations}
    for name, module in former.items():
        assert importlib.import_module(f"rope_ext.{name}") is module
        assert getattr(rope_ext, name) is module
        assert not os.path.exists(os.path.join(ROOT, "rope_ext", name + ".py"))
    import rope_ext._qk_norm_reference as by_statement  # the `import a.b as c` form too

    assert by_statement is reference
