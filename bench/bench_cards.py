"""The README's commands for each card, run: every `python trainer/...` line of its GPU quickstart whose comment
names a card ("on a 24 GB card"), with --base pointed at a folder of the same model (a stand-in from
bench/stand_in.py, or the published weights), a few steps at a chosen resolution, into a folder of its own.
The sample grids draw one prompt in two steps. Prints, for each: the exit code, the wall clock, the peak memory (resident on a CPU; torch's allocated / reserved
on a GPU, from the run's own log) and the run's memory estimate line.

    python bench/stand_in.py /tmp/sd35_medium --preset sd3.5-medium
    python bench/bench_cards.py --folder sd3.5-medium=/tmp/sd35_medium --data my_images/ --resolution 256
    python bench/bench_cards.py --folder sd3.5-medium=/models/sd3.5-medium --data my_images/ --resolution 1024  # GPU

`--resolution` and `--before` go in front of the command's own flags, so a command's own wins (the 12 GB
SD3.5-Large command keeps its 512 px; `--before "--frozen_dtype fp32"` where a CPU computes bf16 convolutions
slowly leaves the int8 commands their int8); `--only` picks commands by a word of their comment.
"""
import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def block_commands(text):
    """(the comment above it in its bash block, or None; the command) for every line of `text`'s bash blocks, lines
    joined at a trailing backslash and split at &&."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        comment = None
        for line in block.replace("\\\n", " ").splitlines():
            if line.startswith("#"):
                comment = line[1:].strip()
            else:
                commands += [(comment, part.strip()) for part in line.split("&&")]
    return commands


def card_commands(readme):
    """(the comment, the words after `python`) of every command in the README's bash blocks under a card comment."""
    return [(comment, shlex.split(command)[1:]) for comment, command in block_commands(readme)
            if comment and re.search(r"\d+ GB card", comment) and command.startswith("python trainer/")]


def with_folder(words, folders, data):
    """The command with --base a local folder of its --preset's model and --data `data`; None where no folder of
    that model was given."""
    words = list(words)
    preset = words[words.index("--preset") + 1]
    if preset not in folders:
        return None
    words[words.index("--base") + 1] = folders[preset]
    words[words.index("--data") + 1] = data
    return words


def peak_line(log):
    """The run's last measured peak ('peak memory after ...'), and its estimate line."""
    peaks = re.findall(r"peak memory after [^\n]*", log)
    estimate = re.findall(r"memory estimate per process: [^\n]*", log)
    return (peaks[-1] if peaks else "no peak logged"), (estimate[0] if estimate else "no estimate logged")


def run_one(words, before, after, folder):
    """Run one command with `before` flags ahead of its own and `after` behind them, in `folder` -> (its exit code,
    its output, seconds, its peak resident memory in GiB)."""
    script, flags = words[0], words[1:]
    paths = ["--out_dir", os.path.join(folder, "out"), "--save_dir", os.path.join(folder, "ckpt"),
             "--cache_dir", os.path.join(folder, "cache")]
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, script, *before, *flags, *after, *paths], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)  # this child's own peak (Linux: KiB)
    return os.waitstatus_to_exitcode(status), output, time.perf_counter() - started, usage.ru_maxrss / 2 ** 20


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", action="append", required=True, help="PRESET=PATH: a folder of that model")
    parser.add_argument("--data", required=True, help="a folder of images with .txt captions")
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--before", default="", help="flags put in front of each command's own")
    parser.add_argument("--only", default="", help="run only the commands whose comment holds this text")
    parser.add_argument("--work", default=None, help="where the runs write (default: a temporary folder)")
    args = parser.parse_args(argv)
    folders = dict(item.split("=", 1) for item in args.folder)
    with open(os.path.join(REPO, "README.md")) as f:
        commands = card_commands(f.read())
    work = args.work or tempfile.mkdtemp(prefix="bench_cards_")
    os.makedirs(work, exist_ok=True)
    prompts = os.path.join(work, "prompts.txt")  # one prompt, two Euler steps: the grids drawn, briefly
    with open(prompts, "w") as f:
        f.write("a photo\n")
    before = ["--resolution", str(args.resolution), *shlex.split(args.before)]  # a command's own --resolution wins
    after = ["--max_steps", str(args.steps), "--sample_steps", "2", "--sample_prompts", prompts]
    for n, (comment, words) in enumerate(commands):
        words = with_folder(words, folders, args.data)
        if words is None or args.only not in comment:
            continue
        code, output, seconds, rss = run_one(words, before, after, os.path.join(work, f"run{n}"))
        peak, estimate = peak_line(output)
        tail = "" if code == 0 else "\n    " + output.strip()[-600:]
        print(f"{comment}\n    exit {code}, {seconds:.0f} s, peak resident {rss:.2f} GiB; {peak}\n"
              f"    {estimate}{tail}", flush=True)


if __name__ == "__main__":
    main()
