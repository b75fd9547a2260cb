"""Write docs/reference/config.md, the reference of every run-config field, from the config
dataclasses themselves (issue 44).

    python tools/config_reference.py           # write the page
    python tools/config_reference.py --check   # exit 1 when the page is stale, a field of
                                               # DOCUMENTED has no docstring, or a main-job
                                               # value that differs gives no reason

Sections follow ``RunConfig``'s nesting (``train`` -> ``train.rollout`` ->
``train.rollout.sampling``, ``train.distributed``). Per field: its dotted name (what ``--set``
and the YAML files take), its annotation, the library default (the section's dataclass built
with no arguments, e.g. ``TrainConfig()``), the main job's value (``RunConfig()``'s, i.e.
configs/default.yaml) and its attribute docstring (the string literal right after the field,
read with ``ast``, as Sphinx and griffe read it; without one, the field's own comment). Where
the two values differ the row says why: the comment above (or on the line of) the keyword in
the ``_main_job_*()`` function that RunConfig's ``default_factory`` names.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import json
import re
import sys
import tokenize
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # this checkout's agentrl_fast, whatever is installed
PAGE = ROOT / "docs" / "reference" / "config.md"
# The classes whose every field must have an attribute docstring; the others' may come later.
DOCUMENTED = ("TrainConfig", "RolloutConfig", "SamplingParams", "DistributedConfig")


@dataclasses.dataclass
class FieldSource:
    """One dataclass field as written: its annotation, attribute docstring and comments."""

    name: str
    annotation: str
    docstring: str | None
    comment: str | None


@dataclasses.dataclass
class ClassSource:
    docstring: str
    fields: dict[str, FieldSource]


def _comments(source: str) -> tuple[dict[int, str], set[int]]:
    """``({line: comment text}, lines holding nothing but a comment)``."""
    found, alone = {}, set()
    lines = source.splitlines()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            line = token.start[0]
            found[line] = token.string.lstrip("#").strip()
            if not lines[line - 1][:token.start[1]].strip():
                alone.add(line)
    return found, alone


def _comment_for(first: int, last: int, comments: dict[int, str], alone: set[int]) -> str | None:
    """The comment block right above line ``first``, then the comment ending line ``last``
    (trailing), joined; None without either."""
    above, line = [], first - 1
    while line in alone:
        above.insert(0, comments[line])
        line -= 1
    parts = above + ([comments[last]] if last in comments and last not in alone else [])
    return " ".join(p for p in parts if p) or None


def _is_dataclass_def(node: ast.ClassDef) -> bool:
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name == "dataclass":
            return True
    return False


def class_sources(source: str) -> dict[str, ClassSource]:
    """Every dataclass defined at the top of ``source``: its docstring and, in order, its
    fields with their annotation, attribute docstring and comment."""
    comments, alone = _comments(source)
    classes = {}
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.ClassDef) and _is_dataclass_def(node)):
            continue
        fields = {}
        body = node.body
        for index, statement in enumerate(body):
            if not (isinstance(statement, ast.AnnAssign)
                    and isinstance(statement.target, ast.Name)):
                continue
            annotation = ast.unparse(statement.annotation)
            if annotation.startswith(("ClassVar", "typing.ClassVar")):
                continue
            after = body[index + 1] if index + 1 < len(body) else None
            docstring = None
            if (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docstring = inspect.cleandoc(after.value.value)
            name = statement.target.id
            fields[name] = FieldSource(name, annotation, docstring,
                                       _comment_for(statement.lineno, statement.end_lineno,
                                                    comments, alone))
        classes[node.name] = ClassSource(inspect.cleandoc(ast.get_docstring(node) or ""), fields)
    return classes


def missing_docstrings(source: str, classes: typing.Iterable[str] | None = None) -> list[str]:
    """``Class.field`` for every field of ``classes`` (default: every dataclass of ``source``)
    without a non-empty attribute docstring."""
    found = class_sources(source)
    names = list(found) if classes is None else [c for c in classes if c in found]
    return [f"{c}.{f.name}" for c in names for f in found[c].fields.values()
            if not (f.docstring or "").strip()]


def main_job_reasons(source: str) -> dict[str, str]:
    """``{dotted field: reason}`` from the ``_main_job_*()`` functions that RunConfig's
    ``default_factory`` names: for each keyword of the config they return (nested config calls
    included), the comment right above its line or at the end of it."""
    comments, alone = _comments(source)
    tree = ast.parse(source)
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    factories = {}  # section -> function name
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "RunConfig":
            for statement in node.body:
                if (isinstance(statement, ast.AnnAssign) and isinstance(statement.value, ast.Call)
                        and isinstance(statement.target, ast.Name)):
                    for keyword in statement.value.keywords:
                        if (keyword.arg == "default_factory" and isinstance(keyword.value, ast.Name)
                                and keyword.value.id in functions):
                            factories[statement.target.id] = keyword.value.id
    reasons = {}

    def walk(call: ast.Call, prefix: str):
        for keyword in call.keywords:
            if keyword.arg is None:
                continue
            if isinstance(keyword.value, ast.Call):
                walk(keyword.value, f"{prefix}{keyword.arg}.")
            last = keyword.lineno if isinstance(keyword.value, ast.Call) else keyword.end_lineno
            reason = _comment_for(keyword.lineno, last, comments, alone)
            if reason:
                reasons[f"{prefix}{keyword.arg}"] = reason

    for section, name in factories.items():
        for node in ast.walk(functions[name]):
            if isinstance(node, ast.Return) and isinstance(node.value, ast.Call):
                walk(node.value, f"{section}.")
    return reasons


# -- the page ------------------------------------------------------------------------------------

@dataclasses.dataclass
class Row:
    path: str
    annotation: str
    library: typing.Any
    main: typing.Any
    doc: str
    reason: str | None
    section: str | None  # a nested section's dotted name


@dataclasses.dataclass
class Section:
    path: str
    cls: type
    doc: str
    rows: list[Row]


def _source_of(cls: type, cache: dict[Path, dict[str, ClassSource]]) -> ClassSource:
    path = Path(inspect.getsourcefile(cls))
    if path not in cache:
        cache[path] = class_sources(path.read_text())
    return cache[path][cls.__name__]


def sections() -> tuple[list[Section], dict[str, str]]:
    """The page's sections, depth first from RunConfig, and the main-job reasons."""
    from agentrl_fast import config as config_module
    from agentrl_fast.config import RunConfig

    reasons = main_job_reasons(Path(inspect.getsourcefile(config_module)).read_text())
    cache: dict[Path, dict[str, ClassSource]] = {}
    found = []

    def visit(path: str, cls: type, library, main):
        written = _source_of(cls, cache)
        hints = typing.get_type_hints(cls)
        section = Section(path, cls, written.docstring, [])
        found.append(section)
        nested = []
        for spec in dataclasses.fields(cls):
            name = spec.name
            dotted = f"{path}.{name}" if path else name
            source = written.fields.get(name)
            doc = (source.docstring or source.comment or "") if source else ""
            annotation = source.annotation if source else str(hints[name])
            tp = hints[name]
            if isinstance(tp, type) and dataclasses.is_dataclass(tp):
                # RunConfig's sections: the dataclass's own default; deeper: the parent's value
                child_library = tp() if cls is RunConfig else getattr(library, name)
                section.rows.append(Row(dotted, annotation, None, None, doc, None, dotted))
                nested.append((dotted, tp, child_library, getattr(main, name)))
                continue
            section.rows.append(Row(dotted, annotation, getattr(library, name),
                                    getattr(main, name), doc, reasons.get(dotted), None))
        for child in nested:
            visit(*child)

    main = RunConfig()
    visit("", RunConfig, main, main)
    return found, reasons


def _value(value) -> str:
    """A value as YAML (and JSON) writes it: ``null``, ``true``, ``"ppo"``, ``[]``."""
    if isinstance(value, tuple):
        value = list(value)
    return f"`{json.dumps(value)}`"


def _markdown(text: str, cell: bool = True) -> str:
    """Docstring text as one line of markdown: Sphinx roles and double backticks to code
    (``:class:`~a.b.C``` to `C`); pipes escaped in a table ``cell``."""
    text = re.sub(r":\w+:`(~?)([^`]+)`",
                  lambda m: f"`{m[2].rsplit('.', 1)[-1] if m[1] else m[2]}`", text)
    text = text.replace("``", "`")
    text = " ".join(text.split())
    return text.replace("|", "\\|") if cell else text


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _heading(section: Section) -> str:
    return f"`{section.path}`: {section.cls.__name__}" if section.path else \
        f"The run: {section.cls.__name__}"


HEADER = """\
# Configuration reference

<!-- Written by `python tools/config_reference.py` from the config dataclasses; do not edit by
hand (tests/test_config_reference.py fails when it is stale). -->

Every field of a run's configuration (`agentrl_fast.config.RunConfig`), section by section. The
dotted name is what `--set` and the YAML files take (`--set train.rollout.context_budget=256`);
values are written as YAML reads them (`null`, `true`). Two values per field:

- **library**: the default of the section's dataclass built with no arguments (`TrainConfig()`,
  `EnvConfig()`, ...; under `train`, the value in `TrainConfig()`): general-purpose, what you get
  building the parts in Python.
- **main job**: `RunConfig()`'s, that is [configs/default.yaml](../../configs/default.yaml), what
  `agentrl-fast train` runs: tuned on the built-in vault task
  ([experiments.md](../experiments.md)). Where it differs it is in bold and the row says why
  (the comments of `_main_job_env()` / `_main_job_train()` in `agentrl_fast/config/__init__.py`).

Each description is the field's docstring in its dataclass, the one place it is written.
"""


def render() -> str:
    """The page's text."""
    found, _ = sections()
    out = [HEADER]
    for section in found:
        out.append(f"\n## {_heading(section)}\n")
        if section.doc:
            out.append(f"\n{_markdown(section.doc, cell=False)}\n")
        out.append("\n| field | type | library | main job | description |\n"
                   "| --- | --- | --- | --- | --- |\n")
        by_path = {s.path: s for s in found}
        for row in section.rows:
            name, kind = f"`{row.path}`", f"`{_markdown(row.annotation)}`"
            doc = _markdown(row.doc)
            if row.section is not None:
                link = f"[{row.section}](#{_anchor(_heading(by_path[row.section]))})"
                out.append(f"| {name} | {kind} | {link} | {link} | {doc} |\n")
                continue
            library, main = _value(row.library), _value(row.main)
            if row.library != row.main:
                main = f"**{main}**"
                why = _markdown(row.reason or "")
                doc = f"{doc}<br>**Main job:** {why}" if doc else f"**Main job:** {why}"
            out.append(f"| {name} | {kind} | {library} | {main} | {doc} |\n")
    return "".join(out)


def problems() -> list[str]:
    """What ``--check`` fails on besides a stale page: fields of DOCUMENTED classes without a
    docstring, main-job values that differ from the library's without a reason."""
    found, _ = sections()
    listed = []
    for section in found:
        if section.cls.__name__ in DOCUMENTED:
            path = Path(inspect.getsourcefile(section.cls))
            listed += [f"{_shown(path)}: {name} has no attribute docstring"
                       for name in missing_docstrings(path.read_text(), [section.cls.__name__])]
    listed += [f"{row.path}: the main job's value differs from the library's, and "
               "_main_job_*() in agentrl_fast/config/__init__.py says not why (a comment above "
               "its keyword)" for s in found for row in s.rows
               if row.section is None and row.library != row.main and not row.reason]
    return listed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when the page is stale or a field is undocumented")
    args = parser.parse_args(argv)
    text = render()
    if not args.check:
        PAGE.parent.mkdir(parents=True, exist_ok=True)
        PAGE.write_text(text)
        print(f"wrote {_shown(PAGE)}")
    found = problems()
    if args.check and (not PAGE.exists() or PAGE.read_text() != text):
        found.insert(0, f"{_shown(PAGE)} is stale: run python tools/config_reference.py")
    for problem in found:
        print(problem, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
