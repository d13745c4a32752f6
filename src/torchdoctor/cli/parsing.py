"""How the command line reads its words: lazy groups that list their commands (so a typo gets
"did you mean"), bare groups that print their help, and wrapper commands (``run -- CMD``) that
check their own options before anything starts.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util

import click


def _exists(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


class HelpfulGroup(click.Group):
    """A bare group prints its help and exits 0 (as git and kubectl do); an unknown command is
    a usage error that names the closest ones."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args and not self.invoke_without_command and not ctx.resilient_parsing:
            click.echo(ctx.get_help(), color=ctx.color)
            ctx.exit(0)
        return super().parse_args(ctx, args)

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        name = args[0]
        if self.get_command(ctx, name) is None and not name.startswith("-"):
            close = difflib.get_close_matches(name, self.list_commands(ctx), n=3, cutoff=0.6)
            hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise click.UsageError(f"No such command {name!r}.{hint}", ctx)
        return super().resolve_command(ctx, args)


class LazyGroup(HelpfulGroup):
    """Sub-commands in modules of their own (each exposing ``command``), imported only when
    they run, so one command never pays for another's imports."""

    def __init__(
        self, *args, commands: dict[str, tuple[str, str]] | None = None, section="Commands", **kw
    ):
        super().__init__(*args, **kw)
        self.lazy_commands = commands or {}
        self.section = section

    def list_commands(self, ctx: click.Context) -> list[str]:
        names = [name for name, (module, _) in self.lazy_commands.items() if _exists(module)]
        return names + [n for n in super().list_commands(ctx) if n not in names]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        entry = self.lazy_commands.get(cmd_name)
        if entry is None or not _exists(entry[0]):
            return super().get_command(ctx, cmd_name)
        return importlib.import_module(entry[0]).command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [
            (name, self.lazy_commands[name][1] if name in self.lazy_commands else "")
            for name in self.list_commands(ctx)
        ]
        rows = [
            (
                name,
                text or (self.commands[name].get_short_help_str() if name in self.commands else ""),
            )
            for name, text in rows
        ]
        if rows:
            with formatter.section(self.section):
                formatter.write_dl(rows)


class Command(click.Command):
    """A command whose old option names still work: ``renamed={"--out": "--out-dir"}`` reads
    ``--out DIR`` as ``--out-dir DIR`` and says once, on stderr, that the name changed. The
    old names stay out of the help."""

    def __init__(self, *args, renamed: dict[str, str] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.renamed = renamed or {}

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, self._renamed_args(args))

    def _renamed_args(self, args: list[str]) -> list[str]:
        if not self.renamed:
            return args
        out: list[str] = []
        warned: set[str] = set()
        for i, word in enumerate(args):
            if word == "--":
                return out + args[i:]
            name, eq, value = word.partition("=")
            new = self.renamed.get(name)
            if new is None:
                out.append(word)
                continue
            if name not in warned:
                warned.add(name)
                click.echo(
                    f"torchdoctor {self.name}: {name} is now {new} (the old name still works "
                    "for now)",
                    err=True,
                )
            out.append(f"{new}{eq}{value}")
        return out


class WrapperCommand(Command):
    """A command that runs another (``torchdoctor run [OPTIONS] -- CMD...``).

    Its own options are read up to ``--`` or the first word that is not an option; an unknown
    option there is a usage error that suggests the closest option, raised before anything
    starts, instead of being run as the command (``--intervl`` is a typo, not a program).
    Everything after ``--`` or after the command's first word is the command's own.
    """

    def __init__(self, *args, **kwargs) -> None:
        settings = kwargs.setdefault("context_settings", {})
        settings.setdefault("ignore_unknown_options", True)
        settings.setdefault("allow_interspersed_args", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        args = self._renamed_args(args)
        self._check_own_options(ctx, args)
        return click.Command.parse_args(self, ctx, args)

    def _check_own_options(self, ctx: click.Context, args: list[str]) -> None:
        takes_value: dict[str, bool] = {}
        shown: list[str] = []
        for param in self.get_params(ctx):
            if isinstance(param, click.Option):
                for name in [*param.opts, *param.secondary_opts]:
                    takes_value[name] = not param.is_flag and not param.count
                    if not param.hidden:
                        shown.append(name)
        i = 0
        while i < len(args):
            word = args[i]
            if word == "--" or not word.startswith("-") or word == "-":
                return
            name = word.split("=", 1)[0]
            if name not in takes_value:
                close = difflib.get_close_matches(name, shown, n=3, cutoff=0.6)
                raise click.NoSuchOption(name, possibilities=close, ctx=ctx)
            i += 2 if takes_value[name] and "=" not in word else 1
