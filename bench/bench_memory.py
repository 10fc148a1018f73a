"""Memory at the real size, measured: each scenario runs as its own process under /usr/bin/time -v (its maximum
resident set size is the peak), on stand-in folders of the published sizes (bench/stand_in.py, made here if
missing), and prints the peak beside the run's own estimate (its "memory estimate per process" line,
model/memory.py) and the issue's target. This machine's RAM stands in for a GPU's memory.

    python bench/bench_memory.py                                  # every scenario (about 25 minutes on 2 cores)
    python bench/bench_memory.py --only lora_large_bf16 lora_large_int8
    python bench/bench_memory.py --stand_ins /data/stand_ins      # where the stand-ins are (35 GB of disk)

Scenarios:
    lora_large_bf16   LoRA on the SD3.5-Large stand-in, base in bf16, 64 px, batch 1, checkpointing, 2 steps
    lora_large_int8   the same with the base in int8 (and the first step's loss against bf16's)
    load_medium_bf16  loading the SD3.5-Medium stand-in's transformer (and its components) in bf16
    load_medium_fp32  the same in fp32
    sft_base_adamw    a full fine-tune of the `base` stand-in, 2 steps: the optimizer's state per parameter
    sft_base_adamw8bit  the same with 8-bit AdamW
    fsdp_base         the same full fine-tune on two processes under FSDP: each rank's peak once the weights are
                      loaded (rank 1 builds nothing but its shards), and over the whole run
    sft_medium_bf16_8bit  a full fine-tune of the SD3.5-Medium stand-in: bf16 weights (stochastic rounding), 8-bit
                      AdamW, 64 px, batch 1, checkpointing, no EMA; 2 steps and a save, a resume, 1 step and a save
    sft_medium_fused  the same with the step fused into backward (--step_in_backward 1)
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.stand_in import write_stand_in  # noqa: E402

GIB = 2 ** 30
STAND_INS = {"large": "sd3.5-large", "medium": "sd3.5-medium", "base": "base"}


def measured(command, log_path, env=None):
    """Run `command` under /usr/bin/time -v -> (its output, peak RSS in bytes, wall seconds, exit code)."""
    t0 = time.time()
    with open(log_path, "w", encoding="utf-8") as log:
        done = subprocess.run(["/usr/bin/time", "-v", *command], stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                              env={**os.environ, **(env or {})})
    with open(log_path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    return text, int(peak.group(1)) * 1024 if peak else None, time.time() - t0, done.returncode


def logged(pattern, text, cast=float):
    found = re.search(pattern, text)
    return cast(found.group(1)) if found else None


def first_loss(out_dir, run):
    with open(os.path.join(out_dir, f"{run}_metrics.jsonl"), encoding="utf-8") as f:
        return json.loads(f.readline())["loss"]


def prompt_file(work):
    """One prompt drawn in one step: the sample grids of an 8B model on a CPU cost little beside the steps."""
    prompt = os.path.join(work, "prompt.txt")
    with open(prompt, "w", encoding="utf-8") as f:
        f.write("a red circle\n")
    return prompt


def lora_large(stand_ins, work, frozen):
    out, prompt = os.path.join(work, f"lora_{frozen}"), prompt_file(work)
    command = [sys.executable, "trainer/train_lora.py", "--base", stand_ins["large"], "--from_weight", "base",
               "--preset", "sd3.5-large", "--frozen_dtype", frozen, "--resolution", "64", "--batch_size", "1",
               "--gradient_checkpointing", "1", "--max_steps", "2", "--prior_data", "none", "--num_samples", "2",
               "--lora_name", "bench", "--out_dir", out, "--save_dir", out, "--cache_dir", os.path.join(work, "cache"),
               "--sample_prompts", prompt, "--sample_steps", "1"]
    return command, out, "lora_bench_sd3.5-large"


def full_fine_tune(stand_ins, work, optimizer, processes=1):
    out, prompt = os.path.join(work, f"sft_{optimizer}_{processes}"), prompt_file(work)
    launcher = [sys.executable] if processes == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
    command = [*launcher, "trainer/train_full_sft.py", "--base", stand_ins["base"], "--from_weight", "base",
               "--preset", "base", "--resolution", "64", "--batch_size", "1", "--num_samples", "4", "--max_steps",
               "2", "--optimizer", optimizer, "--gradient_checkpointing", "1", "--out_dir", out, "--save_dir", out,
               "--cache_dir", os.path.join(work, "cache"), "--sample_prompts", prompt, "--sample_steps", "1"]
    return command + (["--fsdp", "1"] if processes > 1 else []), out


def medium_fine_tune(stand_ins, work, fused):
    """The SD3.5-Medium stand-in's full fine-tune in bf16 with 8-bit AdamW, no EMA: 2 steps and a save, then a
    resume, 1 more step and a save -> the two commands."""
    out, prompt = os.path.join(work, f"sft_medium_{'fused' if fused else 'bf16'}"), prompt_file(work)
    command = [sys.executable, "trainer/train_full_sft.py", "--base", stand_ins["medium"], "--from_weight", "base",
               "--preset", "sd3.5-medium", "--resolution", "64", "--batch_size", "1", "--num_samples", "4",
               "--trained_dtype", "bf16", "--optimizer", "adamw8bit", "--step_in_backward", str(int(fused)),
               "--gradient_checkpointing", "1", "--ema_decay", "0", "--out_dir", out, "--save_dir", out,
               "--cache_dir", os.path.join(work, "cache"), "--sample_prompts", prompt, "--sample_steps", "1"]
    return [command + ["--max_steps", "2"], command + ["--max_steps", "3", "--from_resume", "1"]]


def peaks_logged(text, what):
    """Each rank's peak (bytes) in the run's line "peak memory after <what>: a, b GiB", or None."""
    found = re.search(rf"peak memory after {re.escape(what)}: ([\d., /]+) GiB", text)
    return [float(p.split("/")[-1]) * GIB for p in found.group(1).split(",")] if found else None


def optimizer_bytes_per_parameter(save_dir):
    """The optimizer state in the run's resume file, in bytes per trained parameter (8-bit state counted by its
    codes and scales)."""
    from model.checkpoint import load_torch, state_bytes
    from model.precision import import_torchao

    import_torchao("reading 8-bit optimizer state")  # it declares its state's class safe for weights_only loading
    with open(os.path.join(save_dir, "sft_base_resume.json"), encoding="utf-8") as f:
        record = json.load(f)
    state = load_torch(os.path.join(save_dir, f"sft_base_resume.step{record['step']:08d}.pt"))
    params = sum(t.numel() for t in state["model"].values() if t.is_floating_point()) - \
        state["model"]["pos_embed.pos_embed"].numel()  # a buffer, not trained
    return state_bytes(state["optimizer"]["state"]) / params


def row(name, peak, estimate, target, verdict, note=""):
    fmt = (lambda b: f"{b / GIB:.2f} GiB" if b is not None else "-")
    return f"| {name} | {fmt(peak)} | {fmt(estimate)} | {target} | {verdict} | {note} |"


def run_scenario(name, stand_ins, work, results):
    if name.startswith("lora_large"):
        frozen = name.rsplit("_", 1)[1]
        command, out, run = lora_large(stand_ins, work, frozen)
        text, peak, wall, code = measured(command, os.path.join(work, f"{name}.log"))
        estimate = logged(r"memory estimate per process: ([\d.]+) GiB", text)
        loss = first_loss(out, run) if code == 0 else None
        results[name] = {"peak": peak, "loss": loss}
        limit = 18 if frozen == "bf16" else 10
        note = f"first-step loss {loss:.5f}, {wall:.0f} s" if loss is not None else f"exit {code}"
        if frozen == "int8" and "lora_large_bf16" in results and loss is not None:
            bf16 = results["lora_large_bf16"]["loss"]
            note += f", {100 * abs(loss - bf16) / bf16:.2f}% from bf16's"
        return row(name, peak, estimate and estimate * GIB, f"<= {limit} GiB",
                   "met" if code == 0 and peak <= limit * GIB else "missed", note)
    if name.startswith("load_medium"):
        dtype = name.rsplit("_", 1)[1]
        command = [sys.executable, "bench/bench_memory.py", "--child_load", stand_ins["medium"], dtype]
        text, peak, wall, code = measured(command, os.path.join(work, f"{name}.log"))
        loaded = logged(r"loaded (\d+) bytes", text, int)
        target = 1.1 * loaded + GIB if loaded else None
        return row(name, peak, None, f"<= 1.1 x {loaded / GIB:.2f} + 1 = {target / GIB:.2f} GiB" if loaded else "-",
                   "met" if code == 0 and peak <= target else "missed", f"{wall:.0f} s")
    if name.startswith("sft_base"):
        optimizer = name.split("_", 2)[2]
        command, out = full_fine_tune(stand_ins, work, optimizer)
        text, peak, wall, code = measured(command, os.path.join(work, f"{name}.log"))
        estimate = logged(r"memory estimate per process: ([\d.]+) GiB", text)
        per_param = optimizer_bytes_per_parameter(out) if code == 0 else None
        target = "<= 2.1 B/param" if optimizer == "adamw8bit" else "(AdamW: 8 B/param)"
        verdict = "met" if per_param is not None and (optimizer != "adamw8bit" or per_param <= 2.1) else "missed"
        training, saving = peaks_logged(text, "step 2"), peaks_logged(text, "saving step 2")
        around = f"; {training[0] / GIB:.2f} GiB before the save, {saving[0] / GIB:.2f} after (target: +0.3 at most)" \
            if training and saving else ""
        return row(name, peak, estimate and estimate * GIB, target, verdict,
                   f"optimizer state {per_param:.3f} B/param, {wall:.0f} s{around}" if per_param else f"exit {code}")
    if name.startswith("sft_medium"):
        fused = name.endswith("fused")
        peaks, notes = [], []
        for i, command in enumerate(medium_fine_tune(stand_ins, work, fused)):
            text, peak, wall, code = measured(command, os.path.join(work, f"{name}_{i}.log"))
            peaks.append(peak or 0)
            training, saving = peaks_logged(text, f"step {i + 2}"), peaks_logged(text, f"saving step {i + 2}")
            notes.append(f"{'resumed' if i else 'first'} run {wall:.0f} s, exit {code}" + (
                f", {training[0] / GIB:.2f} GiB before its save, {saving[0] / GIB:.2f} after" if training and saving
                else ""))
        estimate = logged(r"memory estimate per process: ([\d.]+) GiB", text)
        limit = 12 if fused else 16
        return row(name, max(peaks), estimate and estimate * GIB, f"{'<' if fused else '<='} {limit} GiB",
                   "met" if code == 0 and max(peaks) <= limit * GIB else "missed", "; ".join(notes))
    if name == "fsdp_base":
        command, out = full_fine_tune(stand_ins, work, "adamw", processes=2)
        text, peak, wall, code = measured(command, os.path.join(work, f"{name}.log"))
        ranks = re.search(r"peak memory after the weights loaded: ([\d.]+), ([\d.]+) GiB", text)
        estimate = logged(r"memory estimate per process: ([\d.]+) GiB", text)
        from model.model_sd3light import count_parameters, preset_config

        config = preset_config("base")
        shard, block = 4 * count_parameters(config) / 2, 4 * count_parameters(config) / config.num_layers
        target = shard + block + GIB
        rank1 = float(ranks.group(2)) * GIB if ranks else None
        whole = peaks_logged(text, "the run")
        if whole:
            ranks_note = f"whole run by rank: {', '.join(f'{p / GIB:.2f}' for p in whole)} GiB (rank 1 target <= 3.5); "
        else:
            ranks_note = ""
        return row(name + " (rank 1, loaded)", rank1, estimate and estimate * GIB,
                   f"<= shard {shard / GIB:.2f} + block {block / GIB:.2f} + 1 = {target / GIB:.2f} GiB",
                   "met" if rank1 is not None and rank1 <= target else "missed",
                   f"{ranks_note}rank 0 {ranks.group(1)} GiB; whole run's largest process {peak / GIB:.2f} GiB" if ranks else
                   f"exit {code}")
    raise ValueError(name)


SCENARIOS = ("lora_large_bf16", "lora_large_int8", "load_medium_bf16", "load_medium_fp32", "sft_base_adamw",
             "sft_base_adamw8bit", "fsdp_base", "sft_medium_bf16_8bit", "sft_medium_fused")


def child_load(folder, dtype):
    """The measured process of load_medium_*: the components and the transformer, as a stage loads them."""
    import torch

    from model.weights import load_weights

    model, components, _ = load_weights(folder, dtype=torch.float32 if dtype == "fp32" else torch.bfloat16,
                                        components_dtype=torch.bfloat16)
    loaded = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    print(f"loaded {loaded} bytes")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stand_ins", default=os.path.join(tempfile.gettempdir(), "minisd3_stand_ins"))
    parser.add_argument("--work", default=None, help="where the runs write (default: a temporary folder)")
    parser.add_argument("--only", nargs="*", choices=SCENARIOS, default=None)
    parser.add_argument("--child_load", nargs=2, metavar=("FOLDER", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_load:
        return child_load(*args.child_load)
    names = args.only or SCENARIOS
    needed = {key for key in STAND_INS if any(key in name for name in names)}
    stand_ins = {key: os.path.join(args.stand_ins, key) for key in STAND_INS}
    for key in sorted(needed):
        print(f"stand-in {key}: {write_stand_in(stand_ins[key], STAND_INS[key]) / GIB:.2f} GiB", flush=True)
    work = args.work or tempfile.mkdtemp(prefix="bench_memory_")
    os.makedirs(work, exist_ok=True)
    print(f"runs and their logs in {work}" + ("" if args.work else " (the runs removed at the end, --work keeps them)"))
    print("\n| scenario | measured peak | estimate | target | | notes |\n|---|---|---|---|---|---|", flush=True)
    results = {}
    try:
        for name in names:
            print(run_scenario(name, stand_ins, work, results), flush=True)
    finally:
        if not args.work:
            remove_runs(work)


def remove_runs(work):
    """Remove the runs' folders from `work` and keep the logs beside them: a folder of ours in the temporary folder
    would otherwise keep its gigabytes of checkpoints after every measurement."""
    for entry in os.scandir(work):
        if entry.is_dir():
            shutil.rmtree(entry.path, ignore_errors=True)


if __name__ == "__main__":
    main()
