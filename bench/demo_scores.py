"""What the demo benches share: a sampler's GenEval-style scores on the fixed prompt sets, per seed, with its time
per image, and the markdown tables BENCHMARKS.md records them in."""
import time

from eval.eval_geneval import generate, score
from eval.sampling import sample_images

IMAGES_PER_PROMPT = 4  # as eval_geneval.py scores by default


def measure(model, components, specs, sampler, seed, batch_size):
    """-> {"heldout", "train" (overall scores), "tasks" ({task: {split: score}}), "s_per_image"} of one sampler
    and noise seed."""
    t0 = time.perf_counter()
    images = generate(model, components, specs, IMAGES_PER_PROMPT, sampler, seed=seed, batch_size=batch_size)
    seconds = (time.perf_counter() - t0) / sum(len(per_spec) for per_spec in images)
    table, overall, _ = score(specs, images)
    return {"heldout": overall["heldout"], "train": overall["train"], "tasks": table, "s_per_image": seconds}


def measure_row(row, sampler, model, components, specs, seeds, batch_size):
    """Fill `row` ({"label", ...}) with `sampler`'s scores for each noise seed, printing each -> row."""
    row["seeds"] = {}
    for seed in seeds:
        result = row["seeds"][seed] = measure(model, components, specs, sampler, seed, batch_size)
        print(f"{row['label']:<16} seed {seed}: held-out {result['heldout']:.3f}, train {result['train']:.3f}, "
              f"{result['s_per_image'] * 1000:.1f} ms/image", flush=True)
    return row


def grid_row(model, components, prompts, sampler, device):
    """The demo grid's row of a sampler: the prompts with noise seed 0."""
    return sample_images(model, components, prompts, 0, sampler, device)


def per_seed(row, split):
    """'0.234 / 0.230': a row's overall score on a split, seed by seed."""
    return " / ".join(f"{r[split]:.3f}" for r in row["seeds"].values())


def task_table(rows, split):
    """A markdown table of each row's score per task on `split`, the mean over its seeds."""
    tasks = list(next(iter(rows[0]["seeds"].values()))["tasks"])
    lines = [f"| {split} | {' | '.join(tasks)} | overall |", f"|---|{'---|' * (len(tasks) + 1)}"]
    for row in rows:
        seeds = list(row["seeds"].values())
        means = [sum(r["tasks"][task][split] for r in seeds) / len(seeds) for task in tasks]
        overall = sum(r[split] for r in seeds) / len(seeds)
        lines.append(f"| {row['label']} | {' | '.join(f'{m:.3f}' for m in means)} | {overall:.3f} |")
    return "\n".join(lines)
