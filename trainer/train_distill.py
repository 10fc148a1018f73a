"""Distillation (DMD2): a few-step generator from a trained model, sampled in 4 steps without guidance where its
teacher takes 20 steps with classifier-free guidance (40 transformer evaluations).

    python trainer/train_distill.py                                   # a 4-step student of out/pretrain_tiny
    torchrun --nproc_per_node 2 trainer/train_distill.py --fsdp 1
    python trainer/train_distill.py --from_weight sft --gen_steps 2
    python trainer/train_distill.py --base /models/sd3-medium --from_weight base --preset sd3-medium --data my_images/

The recipe (trainer/distillation.py, DMD2 on rectified flow): three copies of `--from_weight`. The teacher is
frozen and guided (--real_guidance, default: the guidance its own sample grids used) where the scores compare at
sigma 0.5 or below, and plain above (a guided target at high noise costs the student its shapes: BENCHMARKS.md).
The fake score learns, every step, the flow loss on the generator's samples (detached). The generator learns every
--gen_update_ratio-th step: it samples from noise on --gen_steps fixed sigmas (the teacher sampler's, shifted
alike), and the distribution-matching loss moves its sample along x0_fake - x0_real, both scores reading it noised
at a random sigma. AdamW for both networks; an EMA of the generator, exported and sampled; the numbers are the
recipe at the end of parse_args. Writes out/distill_<preset>.json (the generator's weights; its record says it
samples in its steps with re-noising and no guidance, which eval/eval_sample.py and eval/eval_geneval.py follow),
sample grids in out/samples/ (step 0: the teacher's weights sampled in the generator's steps), metrics in
out/distill_<preset>_metrics.jsonl and the resume checkpoint (both networks, both optimizers, the EMA, the data
position) checkpoints/distill_<preset>_resume.json. Stop with SIGTERM or Ctrl-C; continue with --from_resume 1.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model.errors import UserError, run_main  # noqa: E402
from model.model_sd3light import PRESETS  # noqa: E402
from model.rectified_flow import PREDICTIONS  # noqa: E402
from model.weights import WeightsExport, run_name, weights_identity  # noqa: E402
from trainer.arguments import (  # noqa: E402
    SAVE_DTYPES, StageParser, add_data_args, add_export_args, add_optimizer_args, add_plumbing_args,
    add_schedule_args, add_validation_args, non_negative_float, positive_float, positive_int, probability,
)
from trainer.checkpointer import export_record  # noqa: E402
from trainer.distillation import (  # noqa: E402
    DistillRecipe, GANHead, Networks, distillation_losses, generator_sigmas, generator_step,
)
from trainer.ema import EMA  # noqa: E402
from trainer.parallel import NamedOptimizerState, data_parallel  # noqa: E402
from trainer.previews import Previews  # noqa: E402
from trainer.startup import open_run, start_up, start_weights_source  # noqa: E402
from trainer.training_run import TrainingRun  # noqa: E402


def parse_args(argv=None):
    parser = StageParser(__doc__)
    run, recipe = parser.identity, parser.recipe
    run.add_argument("--preset", default="tiny", choices=list(PRESETS), help="the size of the teacher's weights")
    run.add_argument("--resolution", type=positive_int, default=32, help="image size the generator draws: the "
                     "side of the square, or the area of the aspect-ratio buckets")
    run.add_argument("--prediction", default=None, choices=PREDICTIONS, help="must be what the teacher predicts "
                     "(leave it unset: it is read from it)")
    recipe.add_argument("--from_weight", default="pretrain", help="the teacher: a stage name in --out_dir "
                        "('pretrain' = pretrain_<preset>, 'sft' = sft_<preset>), the path of a weights manifest or "
                        "of a diffusers folder, or 'base' = --base's transformer")
    recipe.add_argument("--gen_steps", type=positive_int, default=4, help="the generator's sampling steps")
    recipe.add_argument("--gen_shift", type=positive_float, default=None, help="shift of the generator's sigmas; "
                        "default: the teacher's sampling shift")
    recipe.add_argument("--real_guidance", type=non_negative_float, default=None, help="classifier-free guidance "
                        "of the teacher's score; default: what the teacher's sample grids used")
    recipe.add_argument("--guidance_interval", type=probability, nargs=2, default=[0.0, 0.5],
                        metavar=("LOW", "HIGH"), help="the teacher's guidance applies where the scores compare at a "
                        "sigma in (LOW, HIGH]; elsewhere its plain score")
    recipe.add_argument("--gen_update_ratio", type=positive_int, default=5, help="the generator learns every Nth "
                        "step, the fake score every step")
    recipe.add_argument("--score_shift", type=positive_float, default=None, help="shift of the sigmas at which "
                        "the scores compare and the fake score learns; default: --gen_shift")
    recipe.add_argument("--min_sigma", type=probability, default=0.02)
    recipe.add_argument("--max_sigma", type=probability, default=0.98)
    recipe.add_argument("--gan_weight", type=non_negative_float, default=0.0, help="the generator's GAN term "
                        "(a head on the fake score's features tells real latents from generated ones); 0 = off")
    recipe.add_argument("--gan_d_weight", type=non_negative_float, default=1e-2, help="the head's loss weight")
    recipe.add_argument("--fake_learning_rate", type=positive_float, default=None, help="the fake score's (and the "
                        "GAN head's); default: --learning_rate (the generator's)")
    add_optimizer_args(parser)  # batch, learning rate, weight decay, clipping (per network), EMA, seed
    add_schedule_args(parser)  # warmup, cosine decay, epochs or max steps
    add_export_args(parser)
    add_data_args(parser)  # caption prefix, repeats, flips, tags, masks; --val_fraction
    add_validation_args(parser)
    add_plumbing_args(parser)
    # The recipe: 600 steps of 16 captions of 8,000 built-in samples, AdamW at 1e-4 for both networks (weight decay
    # 0.01), 50 warmup steps and constant after (as DMD2), an EMA of the generator of 0.99
    parser.set_defaults(num_samples=8000, batch_size=16, learning_rate=1e-4, warmup_steps=50, min_lr_ratio=1.0,
                        epochs=1, max_steps=600, weight_decay=0.01, grad_clip=1.0, ema_decay=0.99,
                        save_interval=200, sample_interval=400)
    return parser.parse_args(argv)


def check_args(args):
    """What argparse cannot check alone: one line each, before any work."""
    if args.gan_weight > 0 and args.fsdp:
        raise UserError("--gan_weight with --fsdp 1 is not supported yet: train the GAN term under DDP")
    if args.guidance_interval[0] >= args.guidance_interval[1]:
        raise UserError("--guidance_interval {:g} {:g} is empty: LOW must be below HIGH (no guidance at all is "
                        "--real_guidance 1)".format(*args.guidance_interval))


def distill_recipe(args, teacher, autocast, log):
    """The losses' recipe: what --gen_shift, --score_shift and --real_guidance leave unset is the teacher's own
    sampling (its record). -> (the recipe, the generator's sigmas)."""
    gen_shift = args.gen_shift or teacher["sampling"]["shift"]
    guidance = teacher["sampling"]["cfg"] if args.real_guidance is None else args.real_guidance
    recipe = DistillRecipe(teacher["prediction"], autocast, args.gen_steps, gen_shift, args.score_shift or gen_shift,
                           guidance, tuple(args.guidance_interval), args.min_sigma, args.max_sigma, args.gan_weight,
                           args.gan_d_weight)
    sigmas = [round(s, 6) for s in generator_sigmas(recipe.gen_steps, recipe.gen_shift).tolist()]
    low, high = recipe.guidance_interval
    log(f"teacher {teacher['manifest']} (step {teacher['step']}, predicts {teacher['prediction']}, guidance "
        f"{guidance:g} at sigmas in ({low:g}, {high:g}]); the generator samples at sigmas {sigmas}")
    return recipe, sigmas


def networks(args, info, nets, autocast):
    """DDP or FSDP for each network (the teacher sharded, not wrapped), and the GAN head if --gan_weight."""
    teacher, generator, fake = nets["teacher"], nets["generator"], nets["fake_score"]
    head = GANHead(fake.config.inner_dim).to(info.device) if args.gan_weight > 0 else None
    return Networks(data_parallel(teacher.eval(), info, args.compile, autocast), generator,
                    data_parallel(generator, info, args.compile, autocast), fake,
                    data_parallel(fake, info, args.compile, autocast), head,
                    data_parallel(head, info, False, autocast) if head else None)


def generator_export(args, name, generator, components, teacher, recipe, sigmas):
    """What a save exports: the generator's EMA (else its weights), recording how it samples (its steps,
    re-noised, without guidance) and what it was distilled from."""
    sampling = {"steps": recipe.gen_steps, "cfg": 1.0, "shift": recipe.gen_shift, "renoise": True}
    record = export_record(args, "distill", recipe.prediction, sampling, generator.config, components,
                           teacher=weights_identity(teacher, args.out_dir), teacher_sampling=teacher["sampling"],
                           generator_sigmas=sigmas)
    return WeightsExport(os.path.join(args.out_dir, name), generator, components, record,
                         SAVE_DTYPES[args.save_dtype], args.export_pipeline, args.export_single_file)


def main(argv=None):
    args = parse_args(argv)
    check_args(args)
    # cpu_bf16=False: the generator's gradient is the difference of two scores' predictions (bf16 not measured)
    name = run_name("distill", args.preset)
    info, metrics, checkpointer, precision = open_run(args, "distill", name, cpu_bf16=False, frozen_transformer=True)
    torch.manual_seed(args.seed)

    # The teacher's record (its prediction and sampler kept); the components, the data and its cache; three copies of
    # its weights: the teacher frozen (in --frozen_dtype), the generator and the fake score trained
    teacher = start_weights_source(args.from_weight, args.preset, args.prediction, args.out_dir, args.base)
    recipe, sigmas = distill_recipe(args, teacher, precision.autocast, metrics.log)
    start = start_up(args, info, precision, metrics.log, {"teacher": "frozen", "generator": "trained",
                                                          "fake_score": "trained"}, record=teacher)
    if start.dataset is None:  # --cache_only: the cache is built
        return
    nets, components = networks(args, info, start.nets, precision.autocast), start.components

    # AdamW for the generator, the fake score and the GAN head; the generator's EMA is what is exported
    fake_lr = args.fake_learning_rate or args.learning_rate
    trained = {"generator": nets.generator, "fake_score": nets.fake, "gan_head": nets.head}
    optimizers = {name: torch.optim.AdamW(net.parameters(), lr=args.learning_rate, betas=(0.9, 0.999),
                                          weight_decay=args.weight_decay, fused=True)
                  for name, net in trained.items() if net is not None}
    ema = EMA(nets.generator, args.ema_decay, args.ema_device) if args.ema_decay > 0 else None

    export = generator_export(args, name, nets.generator, components, teacher, recipe, sigmas)
    run = TrainingRun(args, info, start.dataset, metrics)
    checkpointer.start(run, export, exported=ema or nets.generator, resolved={
        "prediction": recipe.prediction, **precision.as_args(), "gen_shift": recipe.gen_shift, "score_shift":
        recipe.score_shift, "real_guidance": recipe.real_guidance, "fake_learning_rate": fake_lr},
        identity={"kind": "distill", "teacher": weights_identity(teacher, args.out_dir)}, **trained, ema=ema,
        **{f"{name}_optimizer": NamedOptimizerState(net, optimizers[name]) if net is not None else None
           for name, net in trained.items()})
    previews = Previews(args, info, name, nets.generator, ema, components, start.prompts, export.record["sampling"],
                        recipe.prediction, precision, start.validation, metrics.log)
    previews.first(run, metrics)  # step 0: the teacher's weights sampled in the generator's steps

    for batches in run.steps(nets.generator_train, nets.fake_train, nets.head_train):
        update = run.step % args.gen_update_ratio == 0  # the generator learns every Nth step, the fake score every step
        k = generator_step(run.step, recipe.gen_steps, args.seed)  # the generator draws from its step k
        lr = run.schedule_lr(optimizers["generator"], args.learning_rate, args.warmup_steps, args.min_lr_ratio)
        run.schedule_lr([optimizers[n] for n in ("fake_score", "gan_head") if n in optimizers], fake_lr,
                        args.warmup_steps, args.min_lr_ratio)
        for batch in batches:  # each network's losses of each micro-batch; their gradients accumulate
            run.backward(distillation_losses(nets, components, batch, run.generator, k, update, recipe))
        losses = run.mean_losses()
        norms = {"fake_grad_norm": run.optimizer_step(optimizers["fake_score"], nets.fake.parameters(),
                                                      losses["fake_score"], args.grad_clip)}
        if nets.head is not None:
            norms["gan_grad_norm"] = run.optimizer_step(optimizers["gan_head"], nets.head.parameters(),
                                                        losses["gan_d"], args.grad_clip)
        if update:
            norms["gen_grad_norm"] = run.optimizer_step(optimizers["generator"], nets.generator.parameters(),
                                                        losses["dmd"] + losses.get("gan_g", 0.0), args.grad_clip, ema)
        run.end_step()
        metrics.write(run, lr=lr, **losses, **norms, val_loss=previews.validate(run))
        checkpointer.save(run)  # every --save_interval steps, at the end, and on a stop signal
        previews.grid(run)  # every --sample_interval steps and at the end
    checkpointer.finish(run, components)


if __name__ == "__main__":
    run_main(main)
