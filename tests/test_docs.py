"""Every ```python block in README.md and docs/*.md runs, so the docs cannot rot.

The rules (also in docs/index.md, "Writing docs"):

* each ```python block runs on its own, in a fresh subprocess (several at a time), with a temporary
  directory as cwd and the source tree on PYTHONPATH; it passes if it exits with status 0 within its
  timeout (default 120 s);
* HTML comments on the lines directly above the fence change how it runs:
  ``<!-- torchrun: N -->`` runs it with ``torchrun --standalone --nproc_per_node=N``;
  ``<!-- requires: torchstrategies.Name -->`` skips it (with the reason) while that module or attribute is
  not in the build; ``<!-- timeout: S -->`` allows S seconds;
* anything that must not run (shell commands, output, pseudo-code) uses another fence: ```bash, ```text.

Relative links in the same files must point at files that exist.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from torchstrategies.cli.demo import _run_group

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TIMEOUT = 120.0
_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
_MARKER = re.compile(r"^\s*<!--\s*(torchrun|requires|timeout)\s*:\s*(.+?)\s*-->\s*$")


def doc_files() -> list[Path]:
    return [p for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))] if p.is_file()]


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    code: str
    torchrun: int = 0
    requires: tuple[str, ...] = ()
    timeout: float = DEFAULT_TIMEOUT

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def extract_blocks(path: Path) -> list[Block]:
    """The ```python blocks of one Markdown file, with the markers written above each."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang = m.group(2), m.group(3).lower()
        closing = re.compile(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$")  # no info string
        j = i + 1
        while j < len(lines) and not closing.match(lines[j]):
            j += 1
        if lang in ("python", "py"):
            indent = len(m.group(1))
            body = "\n".join(ln[indent:] if ln[:indent].strip() == "" else ln for ln in lines[i + 1 : j])
            block = Block(path, i + 1, body + "\n")
            k = i - 1
            while k >= 0 and _MARKER.match(lines[k]):
                key, value = _MARKER.match(lines[k]).groups()  # type: ignore[union-attr]
                if key == "torchrun":
                    block.torchrun = int(value)
                elif key == "requires":
                    block.requires += tuple(v.strip() for v in value.split(","))
                else:
                    block.timeout = float(value)
                k -= 1
            blocks.append(block)
        i = j + 1
    return blocks


def _available(dotted: str) -> bool:
    """True if ``dotted`` names an importable module, or an attribute of one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


ALL_BLOCKS = [b for p in doc_files() for b in extract_blocks(p)]


def test_docs_have_python_examples_to_run():
    assert len(ALL_BLOCKS) >= 5  # README + quickstart + logging + cli at least


def _run_block(block: Block, workdir: Path) -> tuple[int, str, bool]:
    script = workdir / "doc_block.py"
    script.write_text(block.code)
    if block.torchrun:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={block.torchrun}",
            str(script),
        ]
    else:
        cmd = [sys.executable, str(script)]
    return _run_group(cmd, block.timeout, str(workdir), echo=False, stderr=True)


@pytest.fixture(scope="module")
def block_results(request, tmp_path_factory) -> dict[str, tuple[int, str, bool]]:
    """Runs the selected blocks concurrently (each still in its own fresh process): most of a block's
    time is starting Python and importing torch, which overlaps well."""
    selected = [
        item.callspec.params["block"]
        for item in request.session.items
        if getattr(item, "callspec", None) is not None and "block" in item.callspec.params
    ]
    runnable = [b for b in selected if all(_available(r) for r in b.requires)]
    workers = max(2, min(4, os.cpu_count() or 2))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {b.id: pool.submit(_run_block, b, tmp_path_factory.mktemp("doc")) for b in runnable}
        return {k: f.result() for k, f in futures.items()}


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=[b.id for b in ALL_BLOCKS])
def test_doc_block_runs(block: Block, block_results):
    missing = [r for r in block.requires if not _available(r)]
    if missing:
        pytest.skip(f"not in this build yet: {', '.join(missing)}")
    code, out, timed_out = block_results[block.id]
    where = f"{block.id} ({'torchrun ' + str(block.torchrun) if block.torchrun else 'python'})"
    # on a timeout the output ends with every process's stacks (demo._show_stacks): keep them all
    assert not timed_out, f"{where} did not finish within {block.timeout:.0f} s:\n{out[-20000:]}"
    assert code == 0, f"{where} exited with status {code}:\n{out[-3000:]}"


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def test_relative_links_point_at_existing_files():
    broken = []
    for path in doc_files():
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)  # links in code are not links
        for target in _LINK.findall(text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # http(s):, mailto:, in-page anchors
            file_part = target.split("#", 1)[0]
            if not (path.parent / file_part).exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_block_extraction_follows_the_rules(tmp_path):
    md = tmp_path / "x.md"
    md.write_text(
        "text\n<!-- torchrun: 2 -->\n<!-- requires: torchstrategies.Nope, torchstrategies.ops -->\n"
        "<!-- timeout: 30 -->\n```python\nprint(1)\n```\n```bash\nrm -rf /\n```\n"
        "- item:\n\n  ```python\n  x = 1\n  ```\n```text\n```python inside text is not a block\n```\n"
    )
    blocks = extract_blocks(md)
    assert [(b.line, b.code, b.torchrun, b.requires, b.timeout) for b in blocks] == [
        (5, "print(1)\n", 2, ("torchstrategies.Nope", "torchstrategies.ops"), 30.0),
        (13, "x = 1\n", 0, (), DEFAULT_TIMEOUT),
    ]
    assert _available("torchstrategies.ops.accumulate_n") and not _available("torchstrategies.Nope")


# ---------------------------------------------------------------- the shell commands the docs give (issue 52)
# A ```bash block is not executed as a whole (it may train for minutes or need hosts), but its commands are
# walked: each runs as written in a new shell of a clean clone after `make demo` / `make build`.
_SHELL_LANGS = ("bash", "sh", "shell")
# Commands that exist only in the project's environment (.venv, which make sets up, or your own after pip).
_NEEDS_ENV = ("torchstrategies", "python", "torchrun", "pytest")
ACTIVATE = "source .venv/bin/activate"
# Documented commands cheap enough to run for real in the walk (the rest are parsed against the CLI).
_RUN_FOR_REAL = (("--help",), ("env",), ("env", "--json", "-"))


@dataclass
class ShellCommand:
    where: str  # file:line of the block
    argv: list[str]  # the command, without VAR=value prefixes
    env_ready: bool  # an earlier command of the block activates .venv (or installs into the current env)
    earlier: str = ""  # the block's commands before this one


def command_files() -> list[Path]:
    return [*doc_files(), ROOT / "benchmarks" / "README.md"]


def shell_commands(path: Path) -> list[ShellCommand]:
    """The commands of every shell block of ``path``: continuation lines joined, comments dropped, split at
    ``;``, ``&&``, ``||`` and ``|``, shell keywords (``for ... do``, ``done``) and ``VAR=value`` prefixes
    left out."""
    import shlex

    out: list[ShellCommand] = []
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        m = _FENCE.match(line)
        if not m or m.group(3).lower() not in _SHELL_LANGS:
            continue
        body = []
        for following in lines[i + 1 :]:
            if _FENCE.match(following):
                break
            body.append(following)
        text = "\n".join(body).replace("\\\n", " ")
        ready, earlier = False, ""
        for raw in text.splitlines():
            words = shlex.split(raw, comments=True)
            command: list[str] = []
            for word in [*words, ";"]:
                if word in (";", "&&", "||", "|"):
                    while command and (re.match(r"^\w+=", command[0]) or command[0] in ("do", "then", "done")):
                        command = command[1:]
                    if command and command[0] not in ("for", "if", "while"):
                        out.append(ShellCommand(f"{path.relative_to(ROOT)}:{i + 1}", command, ready, earlier))
                        ready = ready or " ".join(command) == ACTIVATE or command[:2] == ["pip", "install"]
                        earlier += " ".join(command) + "\n"
                    command = []
                else:
                    command.append(word)
    return out


ALL_COMMANDS = [c for p in command_files() for c in shell_commands(p)]
CLI_COMMANDS = [c for c in ALL_COMMANDS if Path(c.argv[0]).name == "torchstrategies"]


def test_the_docs_give_cli_commands_to_walk():
    assert len(CLI_COMMANDS) >= 20 and any(c.argv[1:] == ["env"] for c in CLI_COMMANDS)


def test_every_documented_command_says_how_a_new_shell_finds_it():
    """After `make demo`, a new shell has no `torchstrategies` (nor the venv's python) on PATH: every block
    that runs one first activates .venv (or installs into the current environment with pip)."""
    unready = [f"{c.where}: {' '.join(c.argv)}" for c in ALL_COMMANDS
               if c.argv[0] in _NEEDS_ENV and not c.env_ready]
    assert not unready, f"put `{ACTIVATE}` first in these blocks:\n" + "\n".join(unready)


def _parse_cli(argv: list[str]) -> None:
    """Parses ``argv`` (after the program name) as the CLI would, without running the command."""
    import warnings

    import click

    from torchstrategies_cli import main

    ctx = main.make_context("torchstrategies", list(argv))
    command: click.Command = main
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # click 8.2+: protected_args, until click 9
        while isinstance(command, click.Group) and (ctx.protected_args or ctx.args):
            _, sub, rest = command.resolve_command(ctx, [*ctx.protected_args, *ctx.args])
            assert sub is not None
            ctx = sub.make_context(sub.name, rest, parent=ctx)
            command = sub


@pytest.mark.parametrize("command", CLI_COMMANDS, ids=[f"{c.where} {' '.join(c.argv[1:])}" for c in CLI_COMMANDS])
def test_every_documented_cli_command_parses(command: ShellCommand):
    import click

    try:
        _parse_cli(command.argv[1:])
    except click.exceptions.Exit as done:  # --help, --version
        assert done.exit_code == 0
    except click.BadParameter as exc:
        made = re.search(r"'([^']+)' does not exist", exc.format_message())
        made_earlier = made and any(str(part) in command.earlier for part in Path(made.group(1)).parents
                                    if len(part.parts) > 2)
        if not made_earlier:
            pytest.fail(f"{command.where}: `{' '.join(command.argv)}` is refused: {exc.format_message()}")
        # else: a path an earlier command of the block makes (python3 -m venv /tmp/tfvenv, then its python)
    except click.ClickException as exc:
        pytest.fail(f"{command.where}: `{' '.join(command.argv)}` is refused: {exc.format_message()}")


def test_the_files_documented_commands_write_are_where_git_ignores_them():
    """A documented command run from the clone's root leaves nothing git would show (issue 52: kernels.json
    and allreduce.json were left in the root)."""
    import shutil
    import subprocess

    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    written = sorted({f"{c.where}: {c.argv[i + 1]}" for c in CLI_COMMANDS for i, a in enumerate(c.argv[:-1])
                      if a in ("--json", "--plot", "--out") and c.argv[i + 1] != "-"})
    assert written, "no documented command writes a file: the walk lost them"
    shown = [w for w in written if subprocess.run(["git", "check-ignore", "-q", "--no-index", w.split(": ")[1]],
                                                  cwd=ROOT).returncode != 0]
    assert not shown, "these files would be left for git to show; write them under bench-results/:\n" + "\n".join(
        shown)


@pytest.mark.timeout(300)
def test_the_cheap_documented_commands_run_as_written_in_a_new_shell():
    """`source .venv/bin/activate` then the command, in a shell whose PATH has no venv, from the clone's root:
    what a newcomer types after `make demo`."""
    import subprocess

    if not (ROOT / ".venv" / "bin" / "activate").is_file():
        pytest.skip("no .venv in this clone (made by `make demo` / `make test`)")
    cheap = sorted({tuple(c.argv[1:]) for c in CLI_COMMANDS if tuple(c.argv[1:]) in _RUN_FOR_REAL})
    assert cheap, "the docs lost their `torchstrategies env` line"
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"), "LANG": "C.UTF-8"}
    for argv in cheap:
        line = f"{ACTIVATE} && torchstrategies {' '.join(argv)}"
        p = subprocess.run(["bash", "-c", line], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
        assert p.returncode == 0, f"`{line}` exited {p.returncode}:\n{p.stdout[-1500:]}\n{p.stderr[-1500:]}"
