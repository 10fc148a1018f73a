"""GenEval-style prompt following on the built-in world: six tasks, each image right only if every clause holds.

    python eval/eval_geneval.py --weights pretrain_tiny                 # generate and score (4 seeds a prompt)
    python eval/eval_geneval.py --ground_truth                          # the scorer's own accuracy, on drawn data

The tasks follow GenEval (Ghosh et al. 2023), phrased in the built-in grammar:
    single_object  "a large red circle in the center"       an object of that shape is there
    two_objects    "a blue square to the left of a red star" both shapes are there
    counting       "three green stars"                       exactly that many of that shape
    colors         "a small yellow diamond at the top"       an object of that shape has that colour
    position       "a red star above a green circle"         both are there, in that relation (by grid cell)
    color_attr     "a red star above a green circle"         a red star and a green circle are both there
Each task has a fixed prompt set from the training grammar and one from the held-out pairs (purple triangle,
orange circle, cyan star: never seen in training). Overall = mean over tasks; the last line printed is the
overall score on the held-out prompts. Objects are read by eval/shape_scorer.py.
"""
import argparse
import json
import os
import random
import sys

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

if not __package__:  # run as a script (imported as a module, the repo root is already importable)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dataset.shapes import (  # noqa: E402
    COLORS, HELD_OUT_PAIRS, NUMBER_WORDS, POSITIONS, RELATIONS, SHAPES, SIZES, ShapesDataset, count_caption,
    image_to_tensor, relation_caption, single_caption,
)
from eval.shape_scorer import COLOR_NAMES, find_objects  # noqa: E402
from model.file_io import atomic_write_text  # noqa: E402
from eval.sampling import (  # noqa: E402
    load_for_sampling, output_path, sample_images, sampler_for, save_grid, to_uint8,
)
from model.errors import run_main  # noqa: E402
from model.weights import DEFAULT_OUT_DIR  # noqa: E402

TASKS = ("single_object", "two_objects", "counting", "colors", "position", "color_attr")
PROMPT_KIND = {"single_object": "single", "colors": "single", "counting": "count", "two_objects": "relation",
               "position": "relation", "color_attr": "relation"}
TRAIN_PAIRS = [(c, s) for c in COLORS for s in SHAPES if (c, s) not in HELD_OUT_PAIRS]
HELD_PAIRS = sorted(HELD_OUT_PAIRS)
PROMPTS_PER_TASK = 24  # the scored prompt sets: per task and split


# ----------------------------------------------------------------------------------------------------------------
# Prompts: fixed sets, a pure function of (task, split, number)


def random_spec(task, rng, own, others):
    """One prompt spec of a task from `rng`, holding a pair of `own` (a relation: with a partner from `others`,
    on either side) -> {"task", "kind", "caption", "objects": [(colour, shape)], ...}, or None for a draw to redo."""
    kind, pair = PROMPT_KIND[task], rng.choice(own)
    spec = {"task": task, "kind": kind}
    if kind == "single":
        size, position = rng.choice(SIZES), rng.choice(POSITIONS)
        spec.update(objects=[pair], size=size, position=position,
                    caption=single_caption(pair[0], pair[1], size, position))
    elif kind == "count":
        count = rng.choice(list(NUMBER_WORDS))
        spec.update(objects=[pair], count=count, caption=count_caption(count, *pair))
    else:
        other = rng.choice(others)
        first, second = (pair, other) if rng.random() < 0.5 else (other, pair)
        if first == second:
            return None
        relation = rng.choice(list(RELATIONS))
        spec.update(objects=[first, second], relation=relation, caption=relation_caption(first, relation, second))
    return spec


def prompt_set(task, split, n, pairs=None):
    """n distinct prompt specs {"task", "split", "caption", "objects": [(colour, shape)], ...} for a task. Each
    prompt holds a pair of the split, or of `pairs` if given (e.g. a colour taught by a LoRA)."""
    rng = random.Random(f"geneval-{task}-{split}" + (f"-{pairs}" if pairs else ""))
    own = pairs or (HELD_PAIRS if split == "heldout" else TRAIN_PAIRS)
    others = TRAIN_PAIRS + own if split == "heldout" or pairs else TRAIN_PAIRS
    specs, captions = [], set()
    for _ in range(100 * n):
        if len(specs) == n:
            break
        spec = random_spec(task, rng, own, others)  # a held-out relation holds a held-out pair, on either side
        if spec is not None and spec["caption"] not in captions:
            captions.add(spec["caption"])
            specs.append({**spec, "split": split})
    return specs


def training_prompts(n, seed, avoid=()):
    """n prompt specs of the training grammar (no held-out pair in any), the six tasks in turn, drawn afresh for
    each `seed`, none of whose captions is in `avoid` (e.g. the scored prompt sets)."""
    rng, specs, avoid = random.Random(f"training-prompts-{seed}"), [], set(avoid)
    while len(specs) < n:
        spec = random_spec(TASKS[len(specs) % len(TASKS)], rng, TRAIN_PAIRS, TRAIN_PAIRS)
        if spec is not None and spec["caption"] not in avoid:
            specs.append({**spec, "split": "train"})
    return specs


# ----------------------------------------------------------------------------------------------------------------
# Scoring: is every clause of the prompt in the image?


def is_correct(spec, found):
    """found: objects from find_objects. -> True if the image satisfies the prompt for its task."""
    task, pairs = spec["task"], spec["objects"]
    shapes = [o["shape"] for o in found]
    if task == "single_object":
        return pairs[0][1] in shapes
    if task == "colors":
        return any((o["color"], o["shape"]) == pairs[0] for o in found)
    if task == "counting":
        return shapes.count(pairs[0][1]) == spec["count"]
    if task == "two_objects":
        (_, a), (_, b) = pairs
        return shapes.count(a) >= 2 if a == b else a in shapes and b in shapes
    if task == "color_attr":
        firsts = [o for o in found if (o["color"], o["shape"]) == pairs[0]]
        seconds = [o for o in found if (o["color"], o["shape"]) == pairs[1]]
        return any(a is not b for a in firsts for b in seconds)
    if task == "position":
        holds = RELATIONS[spec["relation"]]
        firsts = [o for o in found if o["shape"] == pairs[0][1]]
        seconds = [o for o in found if o["shape"] == pairs[1][1]]
        return any(a is not b and holds((a["row"], a["col"]), (b["row"], b["col"])) for a in firsts for b in seconds)
    raise ValueError(f"unknown task {task!r}")


def clauses_held(spec, found):
    """found: objects from find_objects. -> (clauses of the prompt the image satisfies, clauses): a graded
    verdict, from the shapes alone up to the whole prompt and nothing else drawn, so that of two wrong images
    the nearer one scores higher (the preference pairs' reward)."""
    pairs, kind = spec["objects"], spec["kind"]
    shapes, objects = [o["shape"] for o in found], [(o["color"], o["shape"]) for o in found]
    if kind == "single":
        right = [o for o in found if (o["color"], o["shape"]) == pairs[0]]
        clauses = [pairs[0][1] in shapes, bool(right), any(o["position"] == spec["position"] for o in right),
                   any(o["position"] == spec["position"] and o["size"] == spec["size"] for o in right),
                   len(found) == 1]
    elif kind == "count":
        clauses = [pairs[0][1] in shapes, shapes.count(pairs[0][1]) == spec["count"],
                   objects.count(pairs[0]) == spec["count"], len(found) == spec["count"]]
    else:
        holds = RELATIONS[spec["relation"]]

        def related(first, second):  # some first and some other second object in the relation
            return any(a is not b and first(a) and second(b) and holds((a["row"], a["col"]), (b["row"], b["col"]))
                       for a in found for b in found)
        (_, a), (_, b) = pairs
        clauses = [shapes.count(a) >= 2 if a == b else a in shapes and b in shapes,
                   pairs[0] in objects, pairs[1] in objects,
                   related(lambda o: o["shape"] == a, lambda o: o["shape"] == b),
                   related(lambda o: (o["color"], o["shape"]) == pairs[0],
                           lambda o: (o["color"], o["shape"]) == pairs[1]),
                   len(found) == 2]
    return sum(clauses), len(clauses)


def ground_truth_image(spec, resolution, rng):
    """A freshly drawn image that satisfies the prompt, from the dataset's own renderer -> uint8 [H, W, 3]."""
    def place(pair, cell, size):
        return {"color": pair[0], "shape": pair[1], "size": size, "row": cell // 3, "col": cell % 3}

    if spec["kind"] == "single":
        objects = [place(spec["objects"][0], POSITIONS.index(spec["position"]), spec["size"])]
    elif spec["kind"] == "count":
        size = rng.choice(SIZES)
        objects = [place(spec["objects"][0], cell, size) for cell in rng.sample(range(9), spec["count"])]
    else:
        holds = RELATIONS[spec["relation"]]
        a, b = rng.choice([(a, b) for a in range(9) for b in range(9)
                           if holds(divmod(a, 3), divmod(b, 3))])
        objects = [place(spec["objects"][0], a, rng.choice(SIZES)), place(spec["objects"][1], b, rng.choice(SIZES))]
    image = ShapesDataset(resolution=resolution).render({"background": "gray", "objects": objects})
    return np.asarray(image)


def score(specs, images_per_spec, colors=COLOR_NAMES):
    """-> ({task: {split: accuracy}}, {split: overall}, failures [(spec, seed, found)]). `colors`: the palette
    the scorer reads."""
    right, total, failures = {}, {}, []
    for spec, images in zip(specs, images_per_spec):
        key = (spec["task"], spec["split"])
        for seed, image in enumerate(images):
            found = find_objects(image, colors)
            ok = is_correct(spec, found)
            right[key] = right.get(key, 0) + ok
            total[key] = total.get(key, 0) + 1
            if not ok:
                failures.append((spec, seed, found, image))
    splits = list(dict.fromkeys(spec["split"] for spec in specs))
    table = {task: {split: right[(task, split)] / total[(task, split)] for split in splits
                    if (task, split) in total} for task in TASKS}
    overall = {split: float(np.mean([table[task][split] for task in TASKS if split in table[task]]))
               for split in splits}
    return table, overall, failures


def all_prompts(prompts_per_task):
    return [spec for task in TASKS for split in ("train", "heldout") for spec in prompt_set(task, split,
                                                                                         prompts_per_task)]


def ground_truth_accuracy(prompts_per_task=24, seeds=4, resolution=32, seed=0):
    """The scorer on freshly drawn ground truth: (table, overall, failures)."""
    rng = random.Random(seed)
    specs = all_prompts(prompts_per_task)
    return score(specs, [[ground_truth_image(spec, resolution, rng) for _ in range(seeds)] for spec in specs])


def generate(model, components, specs, seeds, sampler, seed=0, batch_size=256):
    """Sample `seeds` images of each spec's caption (fixed noise, from `seed` on) as `sampler` says, `batch_size`
    at a time -> [uint8 [seeds, H, W, 3] per spec]."""
    captions = [spec["caption"] for spec in specs for _ in range(seeds)]
    images = []
    for start in tqdm(range(0, len(captions), batch_size), desc="sampling", leave=False):
        batch = captions[start:start + batch_size]
        images += list(to_uint8(sample_images(model, components, batch, seed + start, sampler,
                                              next(model.parameters()).device)))
    return [images[k:k + seeds] for k in range(0, len(images), seeds)]


# ----------------------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", default=None, help="a stage name in --out_dir, or a path; default: the "
                        "LoRA's base weights, else pretrain_tiny")
    parser.add_argument("--lora", default=None, help="score with this LoRA applied: a name in out/lora, or a path")
    parser.add_argument("--lora_scale", type=float, default=1.0)
    parser.add_argument("--ground_truth", action="store_true", help="score freshly drawn dataset images instead")
    parser.add_argument("--prompts_per_task", type=int, default=PROMPTS_PER_TASK,
                        help="per task and split (train, held-out)")
    parser.add_argument("--seeds", type=int, default=4, help="images per prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resolution", type=int, default=32, help="for --ground_truth")
    parser.add_argument("--steps", type=int, default=None, help="default: what the run sampled with")
    parser.add_argument("--cfg", type=float, default=None)
    parser.add_argument("--shift", type=float, default=None)
    parser.add_argument("--batch_size", type=int, default=256)
    parser.add_argument("--out_dir", default=DEFAULT_OUT_DIR)
    parser.add_argument("--json", default=None, help="report path; default geneval_<weights>.json beside the "
                        "weights (out/ for out/'s runs)")
    parser.add_argument("--failures", default=None, help="PNG of failed images; default samples/... beside the "
                        "weights")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.ground_truth:
        report = {"resolution": args.resolution}

        def default_path(pattern):
            return os.path.join(args.out_dir, pattern.format(name="ground_truth"))
        table, overall, failures = ground_truth_accuracy(args.prompts_per_task, args.seeds, args.resolution,
                                                         args.seed)
    else:
        specs = all_prompts(args.prompts_per_task)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model, components, record, lora_record = load_for_sampling(args.weights, args.out_dir, device, args.lora,
                                                                   args.lora_scale)
        def default_path(pattern):  # beside the weights: runs of the same name elsewhere keep their own reports
            return output_path(record, lora_record, args.out_dir, pattern)

        sampler = sampler_for(record, args.steps, args.cfg, args.shift)
        table, overall, failures = score(specs, generate(model, components, specs, args.seeds, sampler, args.seed,
                                                         args.batch_size))
        report = {"weights": record["manifest"], "step": record["step"], "sampling": sampler.settings(),
                  "lora": args.lora, "lora_scale": args.lora_scale}

    print(f"{'task':<14} {'train':>6} {'held-out':>9}   ({args.prompts_per_task} prompts x {args.seeds} seeds each)")
    for task in TASKS:
        print(f"{task:<14} {table[task]['train']:>6.3f} {table[task]['heldout']:>9.3f}")
    print(f"{'overall':<14} {overall['train']:>6.3f} {overall['heldout']:>9.3f}")
    report.update(prompts_per_task=args.prompts_per_task, seeds=args.seeds, tasks=table, overall=overall,
                  failures=[{"task": s["task"], "split": s["split"], "caption": s["caption"], "seed": seed,
                             "found": found} for s, seed, found, _ in failures])
    json_path = args.json or default_path("geneval_{name}.json")
    atomic_write_text(json_path, json.dumps(report, indent=1) + "\n")
    if failures:
        shown = failures[:48]
        grid_path = args.failures or default_path("samples/geneval_{name}_failures.png")
        images = torch.stack([image_to_tensor(Image.fromarray(img)) for *_, img in shown])
        save_grid(grid_path, images, [f"{s['task']}: {s['caption']}" for s, *_ in shown])
        print(f"{len(failures)} failures, the first {len(shown)} in {grid_path}; report {json_path}")
    else:
        print(f"no failures; report {json_path}")
    print(f"overall: {overall['heldout']:.3f}")


if __name__ == "__main__":
    run_main(main)
