"""Preference tuning (Flow-DPO): teach a trained model to prefer, of two images of a prompt, the one a verifier or a
person chose, so that it draws what the sentence says and not only its words.

    python trainer/train_dpo.py                                    # the demo: tune out/pretrain_tiny on its own pairs
    python trainer/train_dpo.py --lora_rank 16                     # adapters instead of all weights
    python trainer/train_dpo.py --pairs my_pairs.jsonl --from_weight sft
    python trainer/train_dpo.py --base /models/sd3-medium --from_weight base --preset sd3-medium --pairs pairs.jsonl
    torchrun --nproc_per_node 2 trainer/train_dpo.py

It trains the Flow-DPO loss (trainer/preference.py) on pairs whose chosen and rejected images share the noise and
the sigma, against a frozen reference (the starting weights; with --lora_rank, the same model with its adapters
off). With --pairs builtin (the default) the run draws its own pairs: every --pair_refresh steps, fresh prompts of
the training grammar (never a held-out pair, never a prompt the GenEval-style eval scores), each sampled
--pair_images times by the current model, each image scored by the shape scorer (the fraction of its prompt's
clauses that hold), and of each prompt every two images whose scores differ made a pair, the higher scored chosen
(online DPO). Or --pairs a .jsonl with one line {"prompt", "chosen", "rejected"} (image paths) per pair. AdamW on
what trains; the numbers are the recipe at the end of parse_args. Writes
out/dpo_<preset>.json (with --lora_rank: out/lora/lora_<lora_name>_<preset>.safetensors), the metrics (the DPO
loss, the implicit reward accuracy and margin, and each round's pair scores) in out/dpo_<preset>_metrics.jsonl,
sample grids in out/samples/ (step 0: the starting weights) and the resume checkpoint (the policy, its optimizer,
the current pairs) in checkpoints/.
Score it with `python eval/eval_geneval.py --weights dpo_tiny`.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dataset.preference_pairs import PairPool, PreferencePairs  # noqa: E402
from dataset.training_data import validation_data  # noqa: E402
from eval.eval_geneval import PROMPTS_PER_TASK, all_prompts  # noqa: E402
from model.errors import UserError, run_main  # noqa: E402
from model.model_lora import TARGET_GROUPS, LoRAExport, LoRAWeights, apply_lora  # noqa: E402
from model.model_sd3light import PRESETS  # noqa: E402
from model.rectified_flow import PREDICTIONS  # noqa: E402
from model.weights import WeightsExport, lora_file, lora_run_name, run_name, weights_identity  # noqa: E402
from trainer.arguments import (  # noqa: E402
    SAVE_DTYPES, StageParser, add_export_args, add_flow_args, add_optimizer_args, add_plumbing_args,
    add_sampling_args, add_schedule_args, add_validation_args, non_negative_float, non_negative_int, positive_float,
    positive_int,
)
from trainer.checkpointer import export_record  # noqa: E402
from trainer.ema import EMA  # noqa: E402
from trainer.parallel import NamedOptimizerState, data_parallel  # noqa: E402
from trainer.preference import (  # noqa: E402
    DPORecipe, PairRounds, adapters_off_reference, flow_dpo_loss, frozen_copy_reference, pairs_per_prompt,
    refresh_pool,
)
from trainer.previews import Previews, grid_sampling  # noqa: E402
from trainer.startup import open_run, start_up, start_weights_source  # noqa: E402
from trainer.training_run import TrainingRun  # noqa: E402


def parse_args(argv=None):
    parser = StageParser(__doc__)
    run, recipe = parser.identity.add_argument, parser.recipe.add_argument
    run("--preset", default="tiny", choices=list(PRESETS), help="the size of the starting weights")
    run("--resolution", type=positive_int, default=32, help="image size: the side of the square")
    run("--prediction", default=None, choices=PREDICTIONS, help="must be what the starting weights predict (leave "
        "it unset: it is read from them)")
    run("--pairs", default="builtin", help="'builtin' = drawn by the model and scored on the built-in world, or a "
        ".jsonl of {\"prompt\", \"chosen\", \"rejected\"} lines (image paths)")
    run("--lora_rank", type=non_negative_int, default=0, help="0 = tune all weights; else train adapters of this "
        "rank (the reference: the adapters off)")
    run("--lora_name", default="dpo", help="with --lora_rank: out/lora/lora_<name>_<preset>.safetensors")
    recipe("--from_weight", default="pretrain", help="starting weights (the policy and the reference): a stage name "
           "in --out_dir ('pretrain' = pretrain_<preset>, 'sft' = sft_<preset>), the path of a weights manifest or "
           "of a diffusers folder, or 'base' = --base's transformer")
    recipe("--dpo_beta", type=positive_float, default=1000.0, help="how far the policy may move from the reference "
           "for a preference: higher = stays nearer")
    recipe("--lora_alpha", type=positive_float, default=None, help="default: rank (scale 1)")
    recipe("--lora_targets", default="attention", help=f"comma-separated groups ({', '.join(TARGET_GROUPS)}) or "
           "module name suffixes")
    recipe("--pair_prompts", type=positive_int, default=128, help="builtin pairs: prompts drawn a round (the pool "
           "holds as many pairs as their images can make)")
    recipe("--pair_images", type=positive_int, default=8, help="builtin pairs: images a prompt")
    recipe("--pair_choice", default="all", choices=["best_worst", "all"], help="builtin pairs: of a prompt's "
           "images, the best and the worst, or every two whose scores differ")
    recipe("--pair_refresh", type=positive_int, default=25, help="builtin pairs: steps between rounds")
    recipe("--pair_sample_steps", type=positive_int, default=4, help="builtin pairs: Euler steps (a fifth of the "
           "grids', scoring alike: drawing pairs is most of the run's time)")
    recipe("--pair_sample_cfg", type=non_negative_float, default=None, help="default: the starting weights' sampling")
    recipe("--pair_sample_shift", type=positive_float, default=None)
    add_optimizer_args(parser)  # batch (of pairs), learning rate, weight decay, clipping, EMA, seed
    add_schedule_args(parser)  # warmup, cosine decay, epochs or max steps
    add_flow_args(parser, loss=False)  # the sigmas both sides of a pair share
    add_sampling_args(parser)
    add_export_args(parser)
    add_validation_args(parser)  # --val_data: images, scored by the policy's flow loss
    add_plumbing_args(parser, data=None)
    # The recipe: 200 steps of 16 pairs, AdamW at 3e-5 on all weights, 10 warmup steps and constant after, no EMA;
    # sigmas shifted by 3, as the sampler's (the noisy end, where a layout is decided); saved every 100 steps
    parser.set_defaults(batch_size=16, learning_rate=3e-5, warmup_steps=10, min_lr_ratio=1.0, epochs=1,
                        max_steps=200, weight_decay=0.0, grad_clip=1.0, ema_decay=0.0, sigma_scheme="logit_normal",
                        train_shift=3.0, save_interval=100, sample_interval=0)
    return parser.parse_args(argv)


def pair_rounds(args, sampling, prediction, autocast):
    """How --pairs builtin draws its rounds: --pair_sample_cfg and --pair_sample_shift unset are the starting
    weights' `sampling`; the prompts the GenEval-style eval scores are never drawn."""
    cfg = sampling["cfg"] if args.pair_sample_cfg is None else args.pair_sample_cfg
    draw = {"steps": args.pair_sample_steps, "cfg": cfg, "shift": args.pair_sample_shift or sampling["shift"]}
    scored = tuple(spec["caption"] for spec in all_prompts(PROMPTS_PER_TASK))
    return PairRounds(args.pair_prompts, args.pair_images, args.pair_choice, draw, args.seed, args.resolution,
                      prediction, autocast, scored)


def preference_data(pairs_from, rounds):
    """start_up's data: the pairs (a pool the run fills from its own samples, for --pairs builtin, or a manifest's,
    cached when the cache is on), their grid prompts, and the validation images."""
    def data(settings, components, config, log):
        if pairs_from != "builtin":
            pairs = PreferencePairs(pairs_from, settings.resolution, log=log)
        elif components.spec["kind"] != "builtin":
            raise UserError("--pairs builtin draws and scores images of the built-in world, which needs the built-in "
                            "components: with --base, pass a .jsonl of pairs")
        else:
            pairs = PairPool(rounds.prompts * pairs_per_prompt(rounds.images, rounds.choice), settings.resolution)
        return pairs, pairs.sample_prompts(), validation_data(settings, None, log)
    return data


def policy_adapters(args):
    def adapt(model):
        try:
            apply_lora(model, args.lora_targets, args.lora_rank, args.lora_alpha)
        except ValueError as e:
            raise UserError(f"--lora_targets {args.lora_targets}: {e}") from None
    return adapt


def reference_of(args, info, nets, autocast):
    """The frozen reference as a context: the policy with its adapters off (--lora_rank), or the starting weights'
    frozen copy (sharded by FSDP, not wrapped by DDP)."""
    if args.lora_rank:
        return adapters_off_reference(nets["model"])
    return frozen_copy_reference(data_parallel(nets["reference"], info, args.compile, autocast))


def dpo_export(args, name, model, components, record):
    """What a save exports: the policy's adapters naming their base (--lora_rank), or its whole weights."""
    if args.lora_rank:
        return LoRAExport(lora_file(args.out_dir, args.lora_name, args.preset), model, record,
                          SAVE_DTYPES[args.save_dtype])
    return WeightsExport(os.path.join(args.out_dir, name), model, components, record, SAVE_DTYPES[args.save_dtype],
                         args.export_pipeline, args.export_single_file)


def main(argv=None):
    args = parse_args(argv)
    name = lora_run_name(args.lora_name, args.preset) if args.lora_rank else run_name("dpo", args.preset)
    # cpu_bf16=False: the loss is beta times a difference of error differences, as small as bf16's rounding of the
    # prediction (measured on a CPU: bf16 tuned to 0.240 held-out, fp32 to 0.272, for 6% less time)
    info, metrics, checkpointer, precision = open_run(args, "dpo", name, cpu_bf16=False, frozen_transformer=True)
    torch.manual_seed(args.seed)

    # The components, the pairs (and their cache), then the policy and the frozen reference (in --frozen_dtype): a
    # copy of the starting weights, or with adapters, the same model with them off
    source = start_weights_source(args.from_weight, args.preset, args.prediction, args.out_dir, args.base)
    rounds = pair_rounds(args, source["sampling"], source["prediction"], precision.autocast)
    roles = {"model": "adapted"} if args.lora_rank else {"model": "trained", "reference": "frozen"}
    start = start_up(args, info, precision, metrics.log, roles, data=preference_data(args.pairs, rounds),
                     adapt=policy_adapters(args), record=source)
    if start.dataset is None:  # --cache_only: the cache is built
        return
    model, components = start.nets["model"], start.components
    pool = start.dataset if isinstance(start.dataset, PairPool) else None  # builtin pairs: refilled each round
    metrics.log(f"policy {'LoRA rank %d on ' % args.lora_rank if args.lora_rank else ''}{source['manifest']} (step "
                f"{source['step']}), Flow-DPO with beta {args.dpo_beta:g} against "
                f"{'its adapters off' if args.lora_rank else 'a frozen copy'}; pairs: {args.pairs}")
    recipe = DPORecipe(rounds.prediction, args.dpo_beta, args.sigma_scheme, args.logit_mean, args.logit_std,
                       args.train_shift, precision.autocast)

    # DDP or FSDP (the reference sharded, not wrapped); AdamW on what trains: all weights, or the adapters
    train_model = data_parallel(model, info, args.compile, precision.autocast)
    reference = reference_of(args, info, start.nets, precision.autocast)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=args.weight_decay, fused=True)
    trained = LoRAWeights(model) if args.lora_rank else model
    ema = EMA(trained, args.ema_decay, args.ema_device) if args.ema_decay > 0 else None

    # A save: the resume checkpoint (the policy, its optimizer, the current pairs), then the policy (its EMA if on)
    sampling, start_identity = grid_sampling(args), weights_identity(source, args.out_dir)
    record = export_record(args, "dpo", recipe.prediction, sampling, model.config, components,
                           **{"base" if args.lora_rank else "started_from": start_identity})
    run = TrainingRun(args, info, start.dataset, metrics, num_workers=0 if pool else None)  # a pool: no stale copy
    checkpointer.start(run, dpo_export(args, name, model, components, record), exported=ema or trained,
                       identity={"kind": "dpo_lora" if args.lora_rank else "dpo", "start": start_identity},
                       resolved={"prediction": recipe.prediction, **precision.as_args(), **rounds.resolved(pool)},
                       model=trained, optimizer=NamedOptimizerState(model, optimizer), ema=ema, pairs=pool)
    previews = Previews(args, info, name, model, ema, components, start.prompts, sampling, recipe.prediction,
                        precision, start.validation, metrics.log)
    previews.first(run, metrics)  # step 0: the starting weights

    for batches in run.steps(train_model):
        drawn, round_ = {}, (run.step - 1) // args.pair_refresh
        if pool is not None and pool.round != round_:  # builtin pairs: a new round every --pair_refresh steps
            drawn = refresh_pool(pool, round_, model, components, info, rounds, metrics.log)
        lr = run.schedule_lr(optimizer, args.learning_rate, args.warmup_steps, args.min_lr_ratio)
        for batch in batches:  # the DPO loss of each micro-batch of pairs; the gradients accumulate
            run.backward(flow_dpo_loss(train_model, reference, components, batch, run.generator, recipe))
        losses = run.mean_losses()
        grad_norm = run.optimizer_step(optimizer, params, losses["dpo"], args.grad_clip, ema)
        run.end_step()
        metrics.write(run, lr=lr, grad_norm=grad_norm, **losses, **drawn, val_loss=previews.validate(run))
        checkpointer.save(run)  # every --save_interval steps, at the end, and on a stop signal
        previews.grid(run)  # at the end (and every --sample_interval steps if set)
    checkpointer.finish(run, components)


if __name__ == "__main__":
    run_main(main)
