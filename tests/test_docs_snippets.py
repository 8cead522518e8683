"""The commands and code the docs show run as written (or, for the trainer, parse as written).

- docs/integrations.md: the TRL snippet that follows the marker
  `<!-- tested: tests/test_docs_snippets.py -->` is executed on CPU. Two substitutions are made,
  each of which must match exactly once (a doc edit that breaks one fails here, naming it):
  the `model = "..."` line gets the directory of a tiny random Qwen2 with a character tokenizer
  (`fusedrl.tiny`: nothing is downloaded), and `max_completion_length` drops to 8 tokens. The
  snippet runs in a temporary working directory (its `output_dir`), on CPU; the test checks that
  it trained the steps it asks for, through `fusedrl.policy_loss`.
- docs/trainer.md and README.md: every `fusedrl-train ...`, `python -m fusedrl.trainer ...`,
  `torchrun ... -m fusedrl.trainer ...` and `make train [ARGS=...]` command, in code blocks and
  in inline code, goes through the trainer's own parser (`fusedrl.trainer.config.parse_config`:
  flag names, value types, the YAML file, validation) without training. The commands run in a
  temporary directory that holds what the docs create or name: the files their bash blocks write
  with `cat > FILE <<'EOF'` (the example dataset), the doc's YAML block as the `--config` file,
  and for `--resume DIR` a `DIR/config.yaml` of the default job. `<placeholder>`s become a
  string. A dataset the docs write is loaded by `trainer.data.load_rows` with the command's
  columns and scored by the command's reward functions on completions that give the answer, so
  a renamed flag, YAML key, column or reward breaks CI.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- tested: tests/test_docs_snippets.py -->"
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.DOTALL | re.MULTILINE)
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
HEREDOC = re.compile(r"cat > (\S+) <<'?(\w+)'?\n(.*?)\n\2\n", re.DOTALL)
TRAINER_DOCS = ("README.md", "docs/trainer.md")


def _fenced(path: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block of a doc."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer((ROOT / path).read_text())]


# ----------------------------------------------------------------------------- TRL snippet
def _trl_snippet() -> str:
    text = (ROOT / "docs/integrations.md").read_text()
    assert text.count(MARKER) == 1, f"docs/integrations.md: expected one {MARKER!r}"
    after = text.split(MARKER, 1)[1]
    match = FENCE.search(after)
    assert match and match.group(1) == "python" and not after[: match.start()].strip(), (
        f"docs/integrations.md: {MARKER!r} must be followed directly by a ```python block"
    )
    return match.group(2)


def _substitute(code: str, pattern: str, replacement: str) -> str:
    code, count = re.subn(pattern, replacement, code, flags=re.MULTILINE)
    assert count == 1, f"docs/integrations.md TRL snippet: {pattern!r} matched {count} times, not 1"
    return code


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    pytest.importorskip("transformers")
    from fusedrl.tiny import char_tokenizer, tiny_qwen2

    path = tmp_path_factory.mktemp("tiny-model")
    tokenizer = char_tokenizer()
    tiny_qwen2(len(tokenizer), hidden_size=64, num_layers=1).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_trl_snippet_runs_on_cpu(tiny_model_dir, tmp_path, monkeypatch):
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    import fusedrl
    from fusedrl.integrations.trl import FusedGRPOTrainer

    code = _trl_snippet()
    code = _substitute(code, r'^model = "[^"\n]*"', f"model = {tiny_model_dir!r}")
    code = _substitute(code, r"max_completion_length=\d+", "max_completion_length=8")
    max_steps = re.search(r"max_steps=(\d+)", code)
    assert max_steps, "docs/integrations.md TRL snippet: no max_steps="

    calls = []  # (which loss, its config): the drop-in's default is the fused LM head

    def counting(name):
        real = getattr(fusedrl, name)

        def call(*args, **kwargs):
            calls.append((name, kwargs.get("config")))
            return real(*args, **kwargs)

        return call

    for name in ("policy_loss", "linear_policy_loss"):
        monkeypatch.setattr(fusedrl, name, counting(name))
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # `use_cpu=` of the snippet
    monkeypatch.chdir(tmp_path)
    scope: dict = {"__name__": "docs_snippet"}
    exec(compile(code, "docs/integrations.md (TRL snippet)", "exec"), scope)

    trainer = scope["trainer"]
    assert isinstance(trainer, FusedGRPOTrainer)
    assert trainer.args.use_cpu
    assert trainer.state.global_step == int(max_steps.group(1))
    assert calls, "the snippet trained without fusedrl's loss"
    assert {name for name, _ in calls} == {"linear_policy_loss"}  # the fused head, by default
    assert (tmp_path / trainer.args.output_dir).is_dir()


# ------------------------------------------------------------------- fusedrl-train commands
def _trainer_argv(command: str) -> list[str] | None:
    """The fusedrl-train arguments of a shell command, or None if it does not run the trainer."""
    if not re.search(r"fusedrl-train|fusedrl\.trainer|make train", command):
        return None
    command = re.sub(r"<[^<>\n]+>", "placeholder", command)
    tokens = shlex.split(command, comments=True)
    while tokens and (tokens[0] == "time" or re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", tokens[0])):
        tokens = tokens[1:]
    if not tokens:
        return None
    if tokens[0] == "fusedrl-train" or tokens[0].endswith("/fusedrl-train"):
        return tokens[1:]
    if "fusedrl.trainer" in tokens and tokens[tokens.index("fusedrl.trainer") - 1] == "-m":
        return tokens[tokens.index("fusedrl.trainer") + 1 :]
    if tokens[:2] == ["make", "train"]:
        args = [t.split("=", 1)[1] for t in tokens[2:] if t.startswith("ARGS=")]
        return shlex.split(args[0]) if args else []
    return None


def _commands(path: str) -> list[str]:
    """Every shell command of a doc: code-block lines (continuations joined) and inline code."""
    text = (ROOT / path).read_text()
    commands = []
    for lang, body in _fenced(path):
        if lang not in ("", "bash", "sh", "shell", "console"):
            continue
        body = HEREDOC.sub("\n", body)
        commands += [line.strip() for line in body.replace("\\\n", " ").splitlines()]
    prose = FENCE.sub("", text)
    commands += [m.group(1) for m in INLINE.finditer(prose)]
    commands = [" ".join(c.split("#")[0].split()) for c in commands if _trainer_argv(c) is not None]
    return list(dict.fromkeys(commands))  # each once, in order


def _doc_files(path: str) -> dict[str, str]:
    """Files a doc's bash blocks write with `cat > FILE <<'EOF' ... EOF`."""
    files = {}
    for lang, body in _fenced(path):
        if lang in ("bash", "sh", "shell"):
            files.update({m.group(1): m.group(3) + "\n" for m in HEREDOC.finditer(body)})
    return files


def _yaml_blocks(path: str) -> list[str]:
    return [body for lang, body in _fenced(path) if lang in ("yaml", "yml")]


COMMANDS = [(path, command) for path in TRAINER_DOCS for command in _commands(path)]
YAMLS = [(path, i, body) for path in TRAINER_DOCS for i, body in enumerate(_yaml_blocks(path))]


def test_the_docs_show_trainer_commands():
    """The extraction works: the commands and the YAML file the docs are known to show."""
    shown = {path: [c for p, c in COMMANDS if p == path] for path in TRAINER_DOCS}
    assert any(c.startswith("fusedrl-train --model") for c in shown["docs/trainer.md"])
    assert any("--config" in c for c in shown["docs/trainer.md"])
    assert any(c.startswith("make train") for c in shown["README.md"])
    assert [p for p, _, _ in YAMLS] == ["docs/trainer.md"]
    assert "data/math.jsonl" in _doc_files("docs/trainer.md")


def _check_dataset(cfg, files: dict[str, str], where: str) -> None:
    """A dataset the doc writes loads with the command's columns and its rewards score it."""
    if cfg.dataset not in files:
        return
    from fusedrl.trainer.data import load_rows
    from fusedrl.trainer.rewards import parse_rewards, score

    rows = load_rows(cfg.dataset, cfg.prompt_column, cfg.answer_column)
    rewards = parse_rewards(cfg.reward)
    if any(r.name == "math" for r in rewards):
        pytest.importorskip("math_verify")
    columns = {k: [row.get(k) for row in rows] for k in rows[0] if k != "prompt"}
    completions = [f"The answer is \\boxed{{{row['answer']}}}." for row in rows]
    totals, means = score(rewards, [row["prompt"] for row in rows], completions, columns)
    best = sum(r.weight for r in rewards)
    assert totals == pytest.approx([best] * len(rows)), (
        f"{where}: a completion that gives the answer in \\boxed{{}} should get every reward "
        f"({best}); got {totals} ({means})"
    )


def _sandbox(path: str, tmp_path: Path, monkeypatch) -> dict[str, str]:
    files = _doc_files(path)
    for name, content in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(content)
    monkeypatch.chdir(tmp_path)
    return files


@pytest.mark.parametrize(("path", "command"), COMMANDS, ids=[f"{p}: {c}" for p, c in COMMANDS])
def test_trainer_command_parses(path, command, tmp_path, monkeypatch):
    from fusedrl.trainer.config import TrainConfig, parse_config

    argv = _trainer_argv(command)
    files = _sandbox(path, tmp_path, monkeypatch)
    if "--help" in argv or "-h" in argv:
        with pytest.raises(SystemExit) as exc:
            parse_config(argv)
        assert exc.value.code == 0
        return
    if "--config" in argv:
        config = argv[argv.index("--config") + 1]
        yamls = _yaml_blocks(path)
        assert len(yamls) == 1 or config in files, (
            f"{path}: `{command}` names {config}; the doc should show it (one YAML block)"
        )
        if config not in files:
            Path(config).write_text(yamls[0])
    if "--resume" in argv:  # the run it resumes, as the default job would have left it
        run = Path(argv[argv.index("--resume") + 1])
        run.mkdir(parents=True, exist_ok=True)
        (run / "config.yaml").write_text(TrainConfig().to_yaml())
    try:
        cfg = parse_config(argv)
    except SystemExit as exc:  # argparse: unknown flag or a value of the wrong type
        pytest.fail(f"{path}: `{command}`: fusedrl-train's parser rejects it (exit {exc.code})")
    except ValueError as exc:
        pytest.fail(f"{path}: `{command}`: {exc}")
    _check_dataset(cfg, files, f"{path}: `{command}`")


@pytest.mark.parametrize(("path", "index", "body"), YAMLS, ids=[f"{p}#{i}" for p, i, _ in YAMLS])
def test_trainer_yaml_is_a_config(path, index, body, tmp_path, monkeypatch):
    from fusedrl.trainer.config import TrainConfig

    files = _sandbox(path, tmp_path, monkeypatch)
    Path("run.yaml").write_text(body)
    cfg = TrainConfig.from_yaml("run.yaml").validate()
    _check_dataset(cfg, files, f"{path}, YAML block {index}")


# Flags of other programs that docs/trainer.md names, and its notation for boolean options.
NOT_TRAINER_FLAGS = {"--flag", "--no-flag", "--logdir", "--nproc-per-node"}


def test_trainer_doc_names_only_real_options():
    """Every --option docs/trainer.md mentions, prose and tables included, is one of the
    trainer's (or listed above as another program's)."""
    from fusedrl.trainer.config import build_parser

    options = {s for action in build_parser()._actions for s in action.option_strings}
    text = (ROOT / "docs/trainer.md").read_text()
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text))
    assert named - options - NOT_TRAINER_FLAGS == set()


LAYOUT_DIRS = ("fusedrl", "fusedrl/integrations", "kernels", "trainer", "bench", "tools", "csrc")


def test_readme_layout_lists_every_module():
    """README's Layout names every module of the package directories, under its directory."""
    text = (ROOT / "README.md").read_text()
    layout = text.split("## Layout", 1)[1]
    block = FENCE.search(layout).group(2)
    sections: dict[str, str] = {}
    for line in block.splitlines():
        if line and not line[0].isspace():
            current = line.split()[0].rstrip("/")
            sections[current] = ""
            line = line[len(line.split()[0]) :]
        sections[current] += line + "\n"
    missing = []
    for folder in LAYOUT_DIRS:
        directory = ROOT / folder
        names = sorted(p.name for p in directory.iterdir() if p.is_file())
        if folder != "csrc":
            names = [n for n in names if n.endswith((".py", ".sh", ".txt"))]
        text = sections.get(folder, "")
        missing += [
            f"{folder}/{n}" for n in names if not re.search(rf"(?<![\w/]){re.escape(n)}", text)
        ]
    assert not missing, f"README.md ## Layout does not list {missing}"


def test_doc_links_stay_in_the_repo():
    """Every relative link of README.md, docs/ and csrc/README.md names a file of the repo: what
    a reader needs to follow the docs is inside it (web links are citations, not checked)."""
    docs = [ROOT / "README.md", ROOT / "csrc/README.md", *sorted((ROOT / "docs").glob("*.md"))]
    bad = []
    for doc in docs:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (doc.parent / target.split("#")[0]).resolve()
            if not path.is_relative_to(ROOT) or not path.exists():
                bad.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not bad, f"links that leave the repository or name no file: {bad}"
