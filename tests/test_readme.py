"""README.md and docs/ say what the code does: every command the README shows parses (each flag exists and each
value is accepted), each card's command is estimated to fit its card at its resolution, the quickstart comes
first and the README stays short, and every relative link in README.md and docs/ leads to a file and heading that
exist."""
import argparse
import importlib
import os
import re
import shlex

import pytest

from bench.bench_cards import block_commands, card_commands
from model.memory import GIB
from tests.card_estimate import cache_estimate, card_estimate, logged_estimate
from tests.scripts import REPO

PAGES = ["README.md"] + sorted(os.path.join("docs", name) for name in os.listdir(os.path.join(REPO, "docs"))
                               if name.endswith(".md"))
TORCHRUN_FLAGS_WITHOUT_VALUE = {"--standalone"}


def read(page):
    with open(os.path.join(REPO, page)) as f:
        return f.read()


def shown_commands(text):
    """(the comment above it in its code block or None, the command) for every `python <script>` or `torchrun`
    command in `text`: in bash code blocks (lines joined at a trailing backslash, split at &&) and in inline code."""
    commands = block_commands(text)
    inline = re.sub(r"```.*?```", "", text, flags=re.S)
    commands += [(None, " ".join(span.split())) for span in re.findall(r"`((?:python|torchrun) [^`]+)`", inline)]
    return [(comment, command) for comment, command in commands if re.match(r"(python|torchrun) ", command)]


def script_and_argv(command):
    """The repository script a command runs and its arguments, or None (pip, pytest: not ours)."""
    words = shlex.split(command, comments=True)
    if words[0] == "torchrun":
        words = words[1:]
        while words and words[0].startswith("--"):
            words = words[1 if words[0] in TORCHRUN_FLAGS_WITHOUT_VALUE or "=" in words[0] else 2:]
        words = ["torchrun"] + words
    if len(words) < 2 or not words[1].endswith(".py"):
        return None  # python -m pip / pytest, or torchrun's flags alone in a sentence
    return words[1], words[2:]


class Parsed(Exception):
    pass


def parse(script, argv, monkeypatch):
    """The script's arguments parsed as it parses them, without running it: a stage's parse_args; for another
    script its main(argv) stopped right after its argparse parse_args. An unknown flag or a refused value is argparse's
    exit code 2."""
    module = importlib.import_module(script[:-len(".py")].replace("/", "."))
    if script.startswith("trainer/train_"):
        return module.parse_args(argv)
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(parser, args=None, namespace=None):
        raise Parsed(original(parser, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    with pytest.raises(Parsed) as parsed:
        module.main(argv)
    return parsed.value.args[0]


README_COMMANDS = [command for command in shown_commands(read("README.md")) if script_and_argv(command[1])]


@pytest.mark.parametrize("comment, command", README_COMMANDS, ids=[c[1][:60] for c in README_COMMANDS])
def test_every_command_the_readme_shows_parses(comment, command, monkeypatch):
    script, argv = script_and_argv(command)
    assert os.path.isfile(os.path.join(REPO, script)), f"{script} does not exist"
    args = parse(script, argv, monkeypatch)
    card = re.findall(r"(\d+) GB card", comment or "")
    if card:  # a card's command: estimated to fit it while it trains, with a tenth to spare (the estimate of the
        # LoRA recipe was 8% under what an H100 allocated), and while the cache is built before that
        stage = importlib.import_module(script[:-len(".py")].replace("/", "."))
        card_bytes = min(int(n) for n in card) * GIB
        assert card_estimate(stage, args, card_bytes) <= 0.9 * card_bytes, command
        assert cache_estimate(args, card_bytes) <= 0.9 * card_bytes, command
        # what the stage itself logs on a GPU of that size is the figure checked here
        checked = f"{card_estimate(stage, args, card_bytes) / GIB:.1f}"
        assert logged_estimate(stage, args, card_bytes, monkeypatch) == checked, command


def test_the_readme_is_short_and_starts_with_the_gpu_quickstart():
    lines = read("README.md").splitlines()
    assert len(lines) <= 400
    first_lora = next(n for n, line in enumerate(lines, 1) if line.startswith("python trainer/train_lora.py --base"))
    assert first_lora <= 80
    assert len(README_COMMANDS) >= 12
    cards = sum(bool(re.search(r"\d+ GB card", comment or "")) for comment, _ in README_COMMANDS)
    assert cards >= 8 and len(card_commands(read("README.md"))) == cards  # bench/bench_cards.py runs each of them


def slug(heading):
    """GitHub's anchor of a heading: lower case, punctuation dropped but hyphens and underscores, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page):
    text = re.sub(r"```.*?```", "", read(page), flags=re.S)
    return {slug(heading) for heading in re.findall(r"^#+ (.*)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES)
def test_no_dead_links(page):
    text = re.sub(r"```.*?```", "", read(page), flags=re.S)
    dead = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # a web address: not checked offline
        path, _, anchor = target.partition("#")
        where = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if not os.path.exists(os.path.join(REPO, where)):
            dead.append(target)
        elif anchor and anchor not in anchors(where):
            dead.append(target)
    assert not dead, f"{page}: dead links {dead}"


def test_every_reference_page_is_linked_from_the_readme():
    readme = read("README.md")
    assert all(f"]({page})" in readme for page in PAGES if page not in ("README.md", "docs/README.md"))
