"""Text from users and their jobs reaches the terminal as it is (torchdoctor.terminal).

Two kinds of test: a source check that no rich Console, markup string or markup-reading column
exists outside the one factory (so a string from a command line, a path or a recording can never
be parsed as markup), and the commands of the bad-input report as a user typed them."""

from __future__ import annotations

import ast
import io
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

from tests.conftest import REPO, run_td
from torchdoctor.terminal import FALLBACK_WIDTH, make_console

SRC = REPO / "src" / "torchdoctor"
FACTORY = SRC / "terminal.py"
# rich's style words as they open or close a markup tag: "[bold]", "[/dim]", "[bold green]".
STYLE_WORDS = {
    "bold", "dim", "italic", "underline", "reverse", "blink", "strike",
    "red", "green", "yellow", "blue", "magenta", "cyan", "white", "black",
}  # fmt: skip
MARKUP_READERS = {"from_markup", "render_markup"}


def _looks_like_markup(text: str) -> bool:
    """Whether ``text`` holds a rich markup tag made of style words: ``[bold]``, ``[/]``."""
    start = text.find("[")
    while start != -1:
        end = text.find("]", start)
        if end == -1:
            return False
        tag = text[start + 1 : end].lstrip("/").strip()
        if text[start + 1 : end] == "/" or (tag and set(tag.split()) <= STYLE_WORDS):
            return True
        start = text.find("[", start + 1)
    return False


def _problems(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    where = path.relative_to(REPO)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name == "Console" and path != FACTORY:
                found.append(f"{where}:{node.lineno}: a Console made outside make_console")
            if name == "TextColumn" and not any(
                k.arg == "markup" and isinstance(k.value, ast.Constant) and k.value.value is False
                for k in node.keywords
            ):
                found.append(f"{where}:{node.lineno}: TextColumn reads markup (markup=False)")
            if name in MARKUP_READERS and isinstance(func, ast.Attribute):
                found.append(f"{where}:{node.lineno}: {name}() reads or writes markup")
            for k in node.keywords:
                if k.arg == "markup" and not (
                    isinstance(k.value, ast.Constant) and k.value.value is False
                ):
                    found.append(f"{where}:{node.lineno}: markup switched on")
        elif isinstance(node, ast.ImportFrom) and node.module in ("rich", "rich.markup"):
            names = {a.name for a in node.names}
            if node.module == "rich.markup" or names & {"print", "get_console", "print_json"}:
                found.append(f"{where}:{node.lineno}: prints through rich's global console")
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and _looks_like_markup(node.value)
        ):
            found.append(f"{where}:{node.lineno}: a markup string {node.value[:40]!r}")
    return found


def test_no_text_reaches_rich_as_markup():
    """Every Console comes from terminal.make_console (markup off), the project styles its own
    words with Text/style=, and nothing else parses markup: a bracket in a user's argument, a
    path or a recording is printed as it is. This fails on the code as it was (f"[yellow]...")."""
    problems = [p for path in sorted(SRC.rglob("*.py")) for p in _problems(path)]
    assert problems == [], "\n".join(problems)


def test_the_check_sees_what_it_guards_against(tmp_path):
    """The source check above is not vacuous: each pattern it forbids is found."""
    bad = SRC / "_probe_markup_check.py"
    bad.write_text(
        textwrap.dedent(
            """
            from rich.console import Console
            from rich.progress import TextColumn
            from rich.text import Text
            Console().print(f"[yellow]{x}[/yellow]", markup=True)
            TextColumn("{task.description}")
            Text.from_markup("[/]")
            """
        )
    )
    try:
        kinds = " ".join(_problems(bad))
    finally:
        bad.unlink()
    for kind in ("Console made outside", "TextColumn", "from_markup", "switched on", "markup str"):
        assert kind in kinds, kinds


def test_console_prints_brackets_as_they_are():
    out = io.StringIO()
    console = make_console(out, width=200)
    console.print("trainer.devices=[0,1] [/x] [bold]x[/bold] :smile: torchdoctor[attach]")
    assert out.getvalue() == (
        "trainer.devices=[0,1] [/x] [bold]x[/bold] :smile: torchdoctor[attach]\n"
    )


def test_a_columns_variable_of_zero_gives_a_usable_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "0")
    assert make_console(io.StringIO()).width == FALLBACK_WIDTH
    monkeypatch.setenv("COLUMNS", "132")
    assert make_console(io.StringIO()).width == 132


def test_run_a_command_with_markup_in_its_arguments(tmp_path):
    """`torchdoctor run -- python3 -c "print('[/x] hello')"` crashed with a MarkupError before
    the job started and left an empty recording; a Hydra override was mangled."""
    # The interpreter as ./py: the header cuts a long command line at a word, and a deep
    # checkout's interpreter path would push the brackets past the cut.
    (tmp_path / "py").symlink_to(sys.executable)
    (tmp_path / "train.py").write_text("import sys; print('[/x] hello', sys.argv[1])\n")
    for argv, out in [
        (["-c", "print('[/x] hello')"], "[/x] hello\n"),
        (["train.py", "trainer.devices=[0,1]"], "[/x] hello trainer.devices=[0,1]\n"),
    ]:
        rec = tmp_path / f"{argv[0]}.sqlite"
        proc = run_td("run", "--out", str(rec), "--", "./py", *argv, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == out
        assert "Traceback" not in proc.stderr
        header = proc.stderr.splitlines()[0]
        assert argv[-1].replace("'", "'\"'\"'") in header, header  # as typed (shell-quoted)
        assert rec.stat().st_size > 0
        show = run_td("show", str(rec))
        assert show.returncode == 0, show.stderr
        assert argv[-1] in show.stdout, show.stdout


def test_run_into_a_file_name_with_brackets(tmp_path):
    for name in ("a[/x].sqlite", "[bold]x[/bold].sqlite"):
        rec = tmp_path / name
        proc = run_td("run", "--out", str(rec), "--", sys.executable, "-c", "pass")
        assert proc.returncode == 0, proc.stderr
        assert f"recording: {rec}" in proc.stderr
        assert rec.stat().st_size > 0


def test_the_attach_hint_names_the_package_to_install(tmp_path):
    """Without py-spy, attach and show say `pip install ... 'torchdoctor[attach]'` whole (rich
    ate "[attach]", so the advice printed was the command the user had already run). The
    command runs from a Python whose folder has no py-spy, with a PATH that has none either."""
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    site = sysconfig.get_paths()["purelib"]
    env = {
        **os.environ,
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), site]),
    }
    job = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.readline()"], stdin=subprocess.PIPE
    )
    try:
        rec = tmp_path / "a.sqlite"
        attach = subprocess.Popen(
            [str(bare / "bin" / "python"), "-m", "torchdoctor", "attach"]
            + ["--out", str(rec), str(job.pid)],
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        line = attach.stderr.readline()
        while "py-spy" not in line and line:
            line = attach.stderr.readline()
        job.stdin.close()  # the job ends, and attach with it
        job.wait(timeout=30)
        rest = attach.communicate(timeout=60)[1]
    finally:
        job.kill()
    assert "pip install --force-reinstall 'torchdoctor[attach]'" in line + rest, line + rest
    show = run_td("show", str(rec))
    assert "'torchdoctor[attach]'" in show.stdout, show.stdout


def test_columns_zero_still_prints_show_and_the_end_report(tmp_path):
    """Some containers and CI export COLUMNS=0 (a 0x0 pty): show, diagnose and run's end report
    printed nothing at all (probe M7)."""
    rec = tmp_path / "r.sqlite"
    env = {**os.environ, "COLUMNS": "0"}
    proc = run_td("run", "--out", str(rec), "--", sys.executable, "-c", "pass", env=env)
    assert proc.returncode == 0, proc.stderr
    assert f"recording: {rec}" in proc.stderr
    show = run_td("show", str(rec), env=env)
    assert show.returncode == 0 and f"recording: {rec}" in show.stdout, show.stdout
    diagnose = run_td("diagnose", str(rec), env=env)
    assert diagnose.returncode == 0 and "torchdoctor" in diagnose.stdout, diagnose.stdout
