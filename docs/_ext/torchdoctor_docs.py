"""Sphinx extension: writes the manual's reference pages from the code before Sphinx reads.

Nothing here is copied by hand: the CLI pages name the click commands (sphinx-click renders
them), the findings catalogue reads every rule module and the threshold table, the metric
reference reads the exporter's calls, the JSON schema page renders every schema file the
commands ship, the exit-code table renders a module's table when one defines it, and the
benchmark page renders the figures `benchmarks/run_all.py --save` wrote with run_all's own
table function. The pages go to docs/reference/ (not committed; `make clean` removes them).
"""

from __future__ import annotations

import ast
import importlib
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parent.parent
ROOT = DOCS.parent
SRC = ROOT / "src" / "torchdoctor"
REFERENCE = DOCS / "reference"
EXAMPLES = DOCS / "examples"
FIGURES = ROOT / "benchmarks" / "results" / "latest.jsonl"
# Where an exit-code table may live: a mapping of status -> meaning named EXIT_CODES.
EXIT_CODE_MODULES = ("torchdoctor.cli.exit_codes", "torchdoctor.cli.common", "torchdoctor.errors")


# ---------------------------------------------------------------- helpers


def _write(path: Path, text: str) -> None:
    """Write only when the content changed, so Sphinx rebuilds only what changed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")


def _rst_title(text: str, char: str = "=") -> str:
    return f"{text}\n{char * len(text)}\n"


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# ---------------------------------------------------------------- CLI reference


def cli_pages() -> list[str]:
    """One page per command (the man pages torchdoctor-NAME(1)), plus the program's page."""
    from torchdoctor.cli import COMMANDS

    names = []
    for name, (module, summary) in COMMANDS.items():
        body = [
            _rst_title(f"torchdoctor {name}"),
            f"{summary}\n",
            f".. click:: {module}:command\n   :prog: torchdoctor {name}\n   :nested: full\n",
        ]
        example = EXAMPLES / f"{name}.txt"
        body.append(_rst_title("Example", "-"))
        if example.exists():
            body.append(
                "Captured by ``docs/capture_examples.py`` on the bundled example job (the "
                "first line is the command as it ran); the figures are those of the machine "
                "it ran on:\n\n"
                f".. literalinclude:: ../../examples/{name}.txt\n   :language: text\n"
            )
        else:
            body.append(
                "No captured output yet: ``python docs/capture_examples.py " + name + "`` "
                "records one.\n"
            )
        _write(REFERENCE / "cli" / f"{name}.rst", "\n".join(body))
        names.append(name)
    index = [
        _rst_title("Command-line reference"),
        "Generated from the click commands themselves (``torchdoctor.cli``): every option, its "
        "default and its help are the ones the program has. Each command is also a man page "
        "(``man torchdoctor-run``).\n",
        ".. click:: torchdoctor.cli:cli\n   :prog: torchdoctor\n",
        ".. toctree::\n   :maxdepth: 1\n\n" + "".join(f"   {n}\n" for n in names),
    ]
    _write(REFERENCE / "cli" / "index.rst", "\n".join(index))
    return names


# ---------------------------------------------------------------- findings catalogue


@dataclass
class ThresholdField:
    name: str
    default: str
    comment: str


def threshold_fields() -> dict[str, ThresholdField]:
    """The Thresholds dataclass's fields with their defaults and the comment beside each."""
    source = (SRC / "thresholds.py").read_text(encoding="utf-8")
    tree = ast.parse(source)
    lines = source.splitlines()
    fields: dict[str, ThresholdField] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "Thresholds":
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    line = lines[item.lineno - 1]
                    comment = line.split("#", 1)[1].strip() if "#" in line else ""
                    default = ast.unparse(item.value) if item.value is not None else ""
                    fields[item.target.id] = ThresholdField(item.target.id, default, comment)
    return fields


def _render_str(node: ast.AST) -> str:
    """A message as the rule writes it, computed parts shown as {expression}."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        out = []
        for part in node.values:
            if isinstance(part, ast.Constant):
                out.append(str(part.value))
            elif isinstance(part, ast.FormattedValue):
                out.append("{" + ast.unparse(part.value) + "}")
        return "".join(out)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _render_str(node.left) + _render_str(node.right)
    return "{" + ast.unparse(node) + "}"


@dataclass
class Rule:
    module: str
    id: str
    doc: str
    scope: str
    after_others: bool
    thresholds: list[str] = field(default_factory=list)
    reads: list[str] = field(default_factory=list)
    fixes: list[str] = field(default_factory=list)
    settings: list[str] = field(default_factory=list)


READ_PATTERNS = (
    (re.compile(r"host_series\(\s*\"(\w+)\""), "host series `{}`"),
    (re.compile(r"gpu_series\(\s*[^,]*,\s*\"(\w+)\""), "GPU series `{}`"),
    (re.compile(r"s\[\"(?!t\")(\w+)\"\]"), "process samples `{}`"),
    (re.compile(r"ctx\.(steps|loader|settings|job|meta|gpus|ranks|findings|events)\b"), "`ctx.{}`"),
)


def read_rule(module_name: str) -> Rule:
    module = importlib.import_module(f"torchdoctor.diagnosis.rules.{module_name}")
    path = Path(module.__file__ or "")
    source = path.read_text(encoding="utf-8")
    rule = Rule(
        module=module_name,
        id=module.ID,
        doc=(module.__doc__ or "").strip(),
        scope=getattr(module, "SCOPE", "node"),
        after_others=bool(getattr(module, "AFTER_OTHERS", False)),
    )
    rule.thresholds = sorted(set(re.findall(r"thresholds\.(\w+)", source)))
    reads: list[str] = []
    for pattern, label in READ_PATTERNS:
        for name in dict.fromkeys(pattern.findall(source)):
            reads.append(label.format(name))
    rule.reads = reads
    tree = ast.parse(source)
    # recommendation=... on every Finding; a variable is followed to its assignments.
    assigned: dict[str, list[ast.AST]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    assigned.setdefault(target.id, []).append(node.value)
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            assigned.setdefault(node.target.id, []).append(node.value)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        for kw in node.keywords:
            if kw.arg == "recommendation":
                values = assigned.get(kw.value.id, []) if isinstance(kw.value, ast.Name) else []
                if isinstance(kw.value, ast.Name) and values:
                    rule.fixes.append(" ".join(_render_str(v) for v in values))
                else:
                    rule.fixes.append(_render_str(kw.value))
            elif kw.arg == "settings" and isinstance(kw.value, ast.Dict):
                rule.settings += [ast.unparse(k) for k in kw.value.keys if k is not None]
    rule.fixes = list(dict.fromkeys(f for f in rule.fixes if f.strip()))
    return rule


def findings_page() -> None:
    from torchdoctor.diagnosis.rules import RULE_MODULES

    fields = threshold_fields()
    out = [
        "# Findings catalogue\n",
        "Every rule `torchdoctor diagnose` runs, in the order it runs them, generated from the "
        "rule modules (`torchdoctor/diagnosis/rules/`) and the threshold table "
        "(`torchdoctor/thresholds.py`). Thresholds can be changed with `--thresholds FILE` or "
        "`[tool.torchdoctor.thresholds]` in pyproject.toml (see [record and diagnose]"
        "(../record.md#torchdoctor-diagnose)). A fix's computed parts are shown as `{expression}`: the "
        "finding itself prints the measured value.\n",
        "| finding | scope | thresholds |",
        "|---|---|---|",
    ]
    rules = [read_rule(m) for m in RULE_MODULES]
    for r in rules:
        limits = ", ".join(f"`{t}`" for t in r.thresholds) or "-"
        out.append(f"| [`{r.id}`](#{r.id}) | {r.scope} | {limits} |")
    out.append("")
    for r in rules:
        out.append(f"(finding-{r.id})=\n## `{r.id}`\n")
        out.append(r.doc + "\n")
        facts = [f"- **rule module**: `torchdoctor.diagnosis.rules.{r.module}`"]
        scope = (
            "once per job, comparing its ranks (every node's recording)"
            if r.scope == "job"
            else "on each node's recording"
        )
        facts.append(f"- **runs**: {scope}" + ("; after the other rules" if r.after_others else ""))
        if r.reads:
            facts.append("- **reads**: " + ", ".join(r.reads))
        for t in r.thresholds:
            f = fields.get(t)
            if f is not None:
                note = f" ({f.comment})" if f.comment else ""
                facts.append(f"- **threshold** `{t}` = `{f.default}`{note}")
        if r.settings:
            facts.append("- **settings it proposes**: " + ", ".join(f"`{s}`" for s in r.settings))
        out.append("\n".join(facts) + "\n")
        if r.fixes:
            out.append("**Fix** (as the rule words it):\n")
            for fix in r.fixes:
                out.append("```text\n" + fix.strip() + "\n```\n")
    out.append("## Threshold table\n")
    out.append("| threshold | default | meaning |\n|---|---|---|")
    for f in fields.values():
        out.append(f"| `{f.name}` | `{f.default}` | {_md_cell(f.comment)} |")
    _write(REFERENCE / "findings.md", "\n".join(out) + "\n")


# ---------------------------------------------------------------- metric reference


@dataclass
class Series:
    kind: str
    name: str
    doc: str
    labels: list[str]


def _const(node: ast.AST, consts: dict[str, str]) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name) and node.id in consts:
        return consts[node.id]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _const(node.left, consts), _const(node.right, consts)
        if left is not None and right is not None:
            return left + right
    if isinstance(node, ast.JoinedStr):
        return _render_str(node)
    return None


def _labels(node: ast.AST, dicts: dict[str, ast.AST], depth: int = 0) -> list[str]:
    if depth > 5:
        return []
    if isinstance(node, ast.Name) and node.id in dicts:
        return _labels(dicts[node.id], dicts, depth + 1)
    if isinstance(node, ast.Dict):
        out: list[str] = []
        for k, v in zip(node.keys, node.values, strict=True):
            if k is None:
                out += _labels(v, dicts, depth + 1)
            elif isinstance(k, ast.Constant):
                out.append(str(k.value))
        return out
    return []


def exporter_series() -> list[Series]:
    """Every f.gauge/f.counter/f.info call of exporters/metrics.py, loops over literal tables
    followed to each row."""
    tree = ast.parse((SRC / "exporters" / "metrics.py").read_text(encoding="utf-8"))
    consts: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            value = _const(node.value, consts)
            if value is not None:
                consts[node.targets[0].id] = value
    found: list[Series] = []

    def visit(node: ast.AST, env: dict[str, str], dicts: dict[str, ast.AST]) -> None:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            value = _const(node.value, {**consts, **env})
            if value is not None:
                env[name] = value
            if isinstance(node.value, ast.Dict):
                dicts[name] = node.value
        if isinstance(node, ast.For) and isinstance(node.target, ast.Tuple):
            rows = node.iter.elts if isinstance(node.iter, ast.Tuple | ast.List) else []
            names = [t.id if isinstance(t, ast.Name) else "" for t in node.target.elts]
            if rows and all(isinstance(r, ast.Tuple) and len(r.elts) == len(names) for r in rows):
                for row in rows:
                    row_env = dict(env)
                    for n, v in zip(names, row.elts, strict=True):
                        value = _const(v, {**consts, **env})
                        if n and value is not None:
                            row_env[n] = value
                    for child in node.body:
                        visit(child, row_env, dicts)
                return
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("gauge", "counter", "info")
            and len(node.args) >= 3
        ):
            scope = {**consts, **env}
            name, doc = _const(node.args[0], scope), _const(node.args[1], scope)
            if name is not None and doc is not None:
                found.append(Series(node.func.attr, name, doc, _labels(node.args[2], dicts)))
        for child in ast.iter_child_nodes(node):
            visit(child, env, dicts)

    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            visit(node, {}, {})
    unique: dict[str, Series] = {}
    for s in found:
        unique.setdefault(s.name, s)
    return list(unique.values())


def metrics_page() -> None:
    sys.path.insert(0, str(ROOT / "src"))
    from torchdoctor.exporters.metrics import PREFIX

    out = [
        "# Metric reference\n",
        "Every Prometheus series `torchdoctor run --prometheus` and `torchdoctor exporter` "
        "serve, generated from the exporter's own calls (`torchdoctor/exporters/metrics.py`). "
        "A series with no measured value is left out rather than written as 0. "
        "Counters end in `_total`; `_info` series carry strings as labels.\n",
        "| series | type | labels | meaning |",
        "|---|---|---|---|",
    ]
    for s in exporter_series():
        full = PREFIX + s.name + ("_info" if s.kind == "info" else "")
        labels = ", ".join(f"`{label}`" for label in dict.fromkeys(s.labels)) or "-"
        out.append(f"| `{full}` | {s.kind} | {labels} | {_md_cell(s.doc)} |")
    _write(REFERENCE / "metrics.md", "\n".join(out) + "\n")


# ---------------------------------------------------------------- JSON schemas


def schemas_page() -> None:
    files = sorted((SRC / "cli" / "schemas").glob("*.schema.json"))
    out = [
        "# JSON output schemas\n",
        "Every `--json` document carries a schema version; the schemas below are the files the "
        "package ships (`torchdoctor/cli/schemas/*.schema.json`), rendered as they are.\n",
    ]
    if not files:
        out.append("This build of torchdoctor ships no schema files.\n")
    for path in files:
        schema: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        name = path.name.removesuffix(".schema.json")
        out.append(f"## `{name}`\n")
        if schema.get("title"):
            out.append(f"**{schema['title']}**\n")
        if schema.get("description"):
            out.append(str(schema["description"]) + "\n")
        props = schema.get("properties") or {}
        if props:
            required = set(schema.get("required") or [])
            out.append("| field | type | required | meaning |\n|---|---|---|---|")
            for key, prop in props.items():
                kind = prop.get("type", "")
                kind = " or ".join(kind) if isinstance(kind, list) else str(kind)
                if "const" in prop:
                    kind = f"always `{json.dumps(prop['const'])}`"
                elif "enum" in prop:
                    kind = " \\| ".join(f"`{json.dumps(v)}`" for v in prop["enum"])
                elif not kind and "$ref" in prop:
                    kind = f"see `{prop['$ref']}`"
                desc = _md_cell(str(prop.get("description", "")))
                out.append(f"| `{key}` | {kind} | {'yes' if key in required else ''} | {desc} |")
            out.append("")
        out.append(f"`{path.name}`:\n\n```json\n{json.dumps(schema, indent=2)}\n```\n")
    _write(REFERENCE / "schemas.md", "\n".join(out) + "\n")


# ---------------------------------------------------------------- exit codes


def exit_code_table() -> dict[int, str] | None:
    for name in EXIT_CODE_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        table = getattr(module, "EXIT_CODES", None)
        if isinstance(table, dict) and table:
            return {int(k): str(v) for k, v in table.items()}
    return None


def exit_codes_page() -> bool:
    table = exit_code_table()
    if table is None:
        return False
    out = ["# Exit codes\n", "| status | meaning |", "|---|---|"]
    out += [f"| {code} | {_md_cell(text)} |" for code, text in sorted(table.items())]
    _write(REFERENCE / "exit-codes.md", "\n".join(out) + "\n")
    return True


# ---------------------------------------------------------------- benchmarks


def benchmark_table() -> str:
    """The figures run_all.py saved, as run_all's own markdown table."""
    if not FIGURES.exists():
        return "No saved figures: `python benchmarks/run_all.py --save` writes them.\n"
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import run_all
    from scorecard import read_results

    return run_all.table(read_results(str(FIGURES)), markdown=True) + "\n"


# ---------------------------------------------------------------- architecture

_LINK = re.compile(r"\[([^\]]+)\]\((?!https?://|#)([^)]+)\)")


def architecture_page() -> str:
    """ARCHITECTURE.md at the repository root, its links to repository files made plain text
    (they are not pages of the manual), or a line saying it is not there."""
    path = ROOT / "ARCHITECTURE.md"
    if not path.exists():
        return "This checkout has no ARCHITECTURE.md.\n"
    text = path.read_text(encoding="utf-8")
    text = _LINK.sub(lambda m: f"{m.group(1)} (`{m.group(2)}`)", text)
    # Its headings sit under this page's title (lines in code blocks are not headings).
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced and re.match(r"#+ ", line):
            line = "#" + line
        out.append(line)
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- the pages


def generate() -> None:
    sys.path.insert(0, str(ROOT / "src"))
    cli_pages()
    findings_page()
    metrics_page()
    schemas_page()
    pages = ["cli/index", "findings", "metrics", "schemas"]
    if exit_codes_page():
        pages.append("exit-codes")
    else:
        stale = REFERENCE / "exit-codes.md"
        if stale.exists():
            stale.unlink()
    _write(REFERENCE / "benchmark-table.md", benchmark_table())
    _write(REFERENCE / "architecture.md", architecture_page())
    index = [
        "# Reference\n",
        "Generated from the code at build time.\n",
        "```{toctree}\n:maxdepth: 2\n\n" + "\n".join(pages) + "\n```\n",
    ]
    _write(REFERENCE / "index.md", "\n".join(index))


def _on_builder_inited(app: Any) -> None:
    generate()


def setup(app: Any) -> dict[str, Any]:
    app.connect("builder-inited", _on_builder_inited)
    return {"parallel_read_safe": True, "version": "1"}
