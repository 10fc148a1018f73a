"""Where the test suite's time goes, and how long a script takes to start.

    python bench/bench_suite.py startup              # `--help` of two scripts against a bare `import torch`
    python bench/bench_suite.py suite                # the README's test command with --durations=0: the tables
    python bench/bench_suite.py suite -m "not slow"  # the quick subset (arguments after `suite` go to pytest)
    python bench/bench_suite.py tables run.log       # the same tables from the output of an earlier run

`suite` also counts the Python processes the tests start (scripts, torchrun and its workers), with their wall
and CPU seconds: a sitecustomize.py on PYTHONPATH, in a temporary folder, writes a line for each at its exit (a
process killed by SIGKILL writes none). Run it alone on the machine: the tests' timings are the machine's.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DURATION = re.compile(r"^\s*([\d.]+)s (setup|call|teardown)\s+(\S+)")
SUMMARY = re.compile(r"=+ (.*) in ([\d.]+)s")
# written into each process the tests start: its script, wall and CPU seconds, at its exit
PROCESS_LOG = """import atexit, json, os, sys, time
_started = time.time()
def _log():
    cpu = os.times()
    with open(os.environ["BENCH_SUITE_PROCESSES"], "a") as f:
        f.write(json.dumps({"argv": sys.argv[:2], "wall": time.time() - _started,
                            "cpu": cpu.user + cpu.system}) + "\\n")
atexit.register(_log)
"""


def timed(command, runs):
    """Seconds of each of `runs` runs of `command` (from the repo root)."""
    seconds = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run(command, cwd=REPO, check=True, capture_output=True)
        seconds.append(time.perf_counter() - started)
    return seconds


def startup(runs):
    """The start-up of two scripts against importing torch alone, interleaved so that a busy moment hits all."""
    commands = {"import torch": [sys.executable, "-c", "import torch"],
                "train_pretrain.py --help": [sys.executable, "trainer/train_pretrain.py", "--help"],
                "eval_sample.py --help": [sys.executable, "eval/eval_sample.py", "--help"]}
    seconds = {name: [] for name in commands}
    for _ in range(runs):
        for name, command in commands.items():
            seconds[name] += timed(command, 1)
    bare = statistics.median(seconds["import torch"])
    print("| command | median s | min-max s | x import torch |\n|---|---|---|---|")
    for name, values in seconds.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.2f} | {min(values):.2f}-{max(values):.2f} | {median / bare:.2f} |")


def tables(log_lines, top=10):
    """Markdown tables of a pytest --durations=0 output: the total, the time by module, the slowest tests."""
    by_test, summary = {}, None
    for line in log_lines:
        match = DURATION.match(line)
        if match:
            seconds, _, test = match.groups()
            by_test[test] = by_test.get(test, 0.0) + float(seconds)
        found = SUMMARY.search(line)
        if found:
            summary = found.groups()
    by_module = {}
    for test, seconds in by_test.items():
        module = test.split("::")[0]
        count, total = by_module.get(module, (set(), 0.0))
        by_module[module] = (count | {test}, total + seconds)
    total = sum(by_test.values())
    if summary:
        print(f"pytest: {summary[0]} in {float(summary[1]):.0f} s; the tests' own phases sum to {total:.0f} s\n")
    print("| module | tests | s | share |\n|---|---|---|---|")
    for module, (tests, seconds) in sorted(by_module.items(), key=lambda kv: -kv[1][1]):
        print(f"| {module.removeprefix('tests/')} | {len(tests)} | {seconds:.0f} | {seconds / total:.0%} |")
    print(f"\n| the {top} slowest tests (setup + call + teardown) | s |\n|---|---|")
    for test, seconds in sorted(by_test.items(), key=lambda kv: -kv[1])[:top]:
        print(f"| {test.removeprefix('tests/')} | {seconds:.1f} |")


def processes(path):
    """A table of the processes the tests started, by script: how many, their wall and CPU seconds."""
    rows = {}
    with open(path) as f:
        for record in map(json.loads, f):
            argv = record["argv"]
            script = argv[0] if argv and argv[0] not in ("-c", "-m") else " ".join(argv)
            script = os.path.relpath(script, REPO) if os.path.isabs(script) else script
            count, wall, cpu = rows.get(script, (0, 0.0, 0.0))
            rows[script] = (count + 1, wall + record["wall"], cpu + record["cpu"])
    print("\n| process | started | wall s | CPU s |\n|---|---|---|---|")
    for script, (count, wall, cpu) in sorted(rows.items(), key=lambda kv: -kv[1][2]):
        print(f"| {script} | {count} | {wall:.0f} | {cpu:.0f} |")


def suite(pytest_args):
    """The README's test command with --durations=0 (and the arguments given), its output kept in a log for
    `tables`."""
    with tempfile.TemporaryDirectory() as folder:
        with open(os.path.join(folder, "sitecustomize.py"), "w") as f:
            f.write(PROCESS_LOG)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [folder, os.environ.get("PYTHONPATH")])),
               "BENCH_SUITE_PROCESSES": os.path.join(folder, "processes.jsonl")}
        command = [sys.executable, "-m", "pytest", "-q", "--durations=0", "--durations-min=0", "-p", "no:cacheprovider",
                   *pytest_args]
        started = time.perf_counter()
        result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
        log = os.path.join(tempfile.gettempdir(), "bench_suite.log")  # for `tables` later
        with open(log, "w") as f:
            f.write(result.stdout + result.stderr)
        print(f"{' '.join(command[1:])}: exit {result.returncode}, {time.perf_counter() - started:.0f} s wall; "
              f"its output in {log}\n")
        print(result.stdout.splitlines()[-1] if result.stdout else result.stderr[-2000:])
        tables(result.stdout.splitlines())
        if os.path.exists(env["BENCH_SUITE_PROCESSES"]):
            processes(env["BENCH_SUITE_PROCESSES"])
    return result.returncode


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("startup").add_argument("--runs", type=int, default=7)
    commands.add_parser("suite", prefix_chars="+").add_argument("pytest_args", nargs="*")
    commands.add_parser("tables").add_argument("log")
    args, rest = parser.parse_known_args()
    if args.command == "startup":
        startup(args.runs)
    elif args.command == "suite":
        return suite(args.pytest_args + rest)
    else:
        with open(args.log) as f:
            tables(f.read().splitlines())
    return 0


if __name__ == "__main__":
    sys.exit(main())
