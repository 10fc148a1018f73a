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
5th step: it samples from noise on 4 fixed sigmas (the teacher sampler's, shifted alike), and the
distribution-matching loss moves its sample along x0_fake - x0_real, both scores reading it noised at a random
sigma. AdamW at 1e-4 for both, 50 warmup steps, constant after; an EMA of the generator (0.99), exported and
sampled; 600 steps of 16 captions from the built-in data; saved every 200 steps and at the end. Writes
out/distill_<preset>.json (the generator's weights; its record says it samples in 4 steps with re-noising and no
guidance, which eval/eval_sample.py and eval/eval_geneval.py follow), sample grids in out/samples/ (step 0: the
teacher's weights sampled in 4 steps), metrics in out/distill_<preset>_metrics.jsonl and the resume checkpoint
(both networks, both optimizers, the EMA, the data position) checkpoints/distill_<preset>_resume.json. Stop with
SIGTERM or Ctrl-C; continue with --from_resume 1.
"""
import contextlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model.checkpoint import manifest_path  # noqa: E402
from model.errors import UserError, run_main  # noqa: E402
from model.model_sd3light import PRESETS  # noqa: E402
from model.rectified_flow import PREDICTIONS  # noqa: E402
from model.weights import export_weights, run_name, start_weights_source, weights_identity  # noqa: E402
from trainer.arguments import (  # noqa: E402
    SAVE_DTYPES, StageParser, add_data_args, add_plumbing_args, add_validation_args, autocast_dtype, decay,
    non_negative_float, non_negative_int, positive_float, positive_int, probability,
)
from trainer.distillation import (  # noqa: E402
    GANHead, Networks, distillation_losses, generator_sigmas, generator_step,
)
from trainer.parallel import NamedOptimizerState, data_parallel  # noqa: E402
from trainer.startup import start_up  # noqa: E402
from trainer.trainer_utils import EMA, init_distributed  # noqa: E402
from trainer.training_run import TrainingRun  # noqa: E402


def parse_args(argv=None):
    parser = StageParser(__doc__)
    run, recipe, length, free = parser.identity, parser.recipe, parser.length, parser.free
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
    recipe.add_argument("--num_samples", type=positive_int, default=8000, help="size of the built-in dataset")
    recipe.add_argument("--batch_size", type=positive_int, default=16, help="per process")
    recipe.add_argument("--accumulation_steps", type=positive_int, default=1)
    recipe.add_argument("--learning_rate", type=positive_float, default=1e-4, help="the generator's")
    recipe.add_argument("--fake_learning_rate", type=positive_float, default=None, help="the fake score's (and the "
                        "GAN head's); default: --learning_rate")
    recipe.add_argument("--warmup_steps", type=non_negative_int, default=50)
    recipe.add_argument("--min_lr_ratio", type=probability, default=1.0, help="after warmup the rates decay along a "
                        "cosine to this fraction of them (1 = constant, as DMD2)")
    recipe.add_argument("--weight_decay", type=non_negative_float, default=0.01)
    recipe.add_argument("--grad_clip", type=positive_float, default=1.0, help="max gradient norm, per network")
    recipe.add_argument("--ema_decay", type=decay, default=0.99, help="EMA of the generator, exported and sampled; "
                        "0 = none")
    recipe.add_argument("--seed", type=non_negative_int, default=0)
    length.add_argument("--epochs", type=positive_int, default=1)
    length.add_argument("--max_steps", type=non_negative_int, default=600, help="optimizer steps; 0 = run "
                        "--epochs")
    free.add_argument("--export_pipeline", action="store_true", help="also write out/<run>/ as a full diffusers "
                      "pipeline folder whose scheduler samples the generator's steps (needs --base and "
                      "v-prediction)")
    free.add_argument("--export_single_file", action="store_true", help="also write out/<run>_single_file"
                      ".safetensors: the original SD3 layout in bf16, for ComfyUI's Load Diffusion Model, Forge and "
                      "diffusers' from_single_file (needs v-prediction)")
    add_data_args(parser)  # caption prefix, repeats, flips, tags, masks; --val_fraction
    add_validation_args(parser)
    add_plumbing_args(parser)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.gan_weight > 0 and args.fsdp:
        raise UserError("--gan_weight with --fsdp 1 is not supported yet: train the GAN term under DDP")
    if args.guidance_interval[0] >= args.guidance_interval[1]:
        raise UserError("--guidance_interval {:g} {:g} is empty: LOW must be below HIGH (no guidance at all is "
                        "--real_guidance 1)".format(*args.guidance_interval))
    info = init_distributed(args.fsdp, args.fsdp_shard_size)
    torch.manual_seed(args.seed)

    # The teacher's record (its prediction, sampler and components are kept); the generator samples in --gen_steps
    start = start_weights_source(args.from_weight, args.preset, args.prediction, args.out_dir, args.base)
    args.gen_shift = args.gen_shift or start["sampling"]["shift"]
    args.score_shift = args.score_shift or args.gen_shift
    args.real_guidance = start["sampling"]["cfg"] if args.real_guidance is None else args.real_guidance
    args.fake_learning_rate = args.fake_learning_rate or args.learning_rate
    sigmas = [round(s, 6) for s in generator_sigmas(args.gen_steps, args.gen_shift).tolist()]
    # The generator's gradient is the difference of two scores' predictions: on a CPU, --dtype fast keeps fp32
    # (bf16 was not measured here)
    run = TrainingRun(args, info, "distill", run_name("distill", args.preset),
                      sampling={"steps": args.gen_steps, "cfg": 1.0, "shift": args.gen_shift, "renoise": True},
                      cpu_bf16=False, frozen_transformer=True)
    low, high = args.guidance_interval
    run.log(f"teacher {start['manifest']} (step {start['step']}, predicts {start['prediction']}, guidance "
            f"{args.real_guidance:g} at sigmas in ({low:g}, {high:g}]); the generator samples at sigmas {sigmas}")
    # The components, the data and its cache, then three copies of the weights: the teacher frozen (in
    # --frozen_dtype), the generator and the fake score trained
    nets = start_up(args, info, run, {"teacher": "frozen", "generator": "trained", "fake_score": "trained"},
                    record=start)
    if nets.dataset is None:  # --cache_only: the cache is built
        return
    teacher, generator, fake = nets.nets["teacher"], nets.nets["generator"], nets.nets["fake_score"]
    components, dataset, prompts, validation = nets.components, nets.dataset, nets.prompts, nets.validation
    teacher.eval()

    # DDP or FSDP for each network (the teacher sharded, not wrapped); AdamW for the generator, the fake score and
    # the GAN head; the generator's EMA is what is exported
    precision = autocast_dtype(args.dtype, info.device)
    head = GANHead(fake.config.inner_dim).to(info.device) if args.gan_weight > 0 else None
    nets = Networks(data_parallel(teacher, info, args.compile, precision), generator,
                    data_parallel(generator, info, args.compile, precision), fake,
                    data_parallel(fake, info, args.compile, precision), head,
                    data_parallel(head, info, False, precision) if head else None)
    trained = {"generator": generator, "fake_score": fake, "gan_head": head}
    optimizers = {name: torch.optim.AdamW(net.parameters(), lr=args.learning_rate, betas=(0.9, 0.999),
                                          weight_decay=args.weight_decay, fused=True)
                  for name, net in trained.items() if net is not None}
    ema = EMA(generator, args.ema_decay, args.ema_device) if args.ema_decay > 0 else None
    stem, teacher_identity = os.path.join(args.out_dir, run.name), weights_identity(start, args.out_dir)

    def export(step, weights):  # the generator's EMA (else its weights), recording how it samples
        record = run.weights_record(generator.config, components, teacher=teacher_identity,
                                    teacher_sampling=start["sampling"], generator_sigmas=sigmas)
        return export_weights(stem, step, generator, weights, components, record, SAVE_DTYPES[args.save_dtype],
                              args.export_pipeline, args.export_single_file)

    def sample_model():
        return ema.swapped_in(generator) if ema else contextlib.nullcontext(generator)

    run.start(dataset, components, prompts, manifest_path(stem), exported=ema or generator,
              identity={"kind": "distill", "teacher": teacher_identity}, first_grid=sample_model,
              generator=generator, fake_score=fake, gan_head=head, ema=ema, validation=validation,
              **{f"{name}_optimizer": NamedOptimizerState(net, optimizers[name]) if net is not None else None
                 for name, net in trained.items()})
    # Each step: the generator draws (from its step k, backward simulation) -> the fake score's flow loss (and the
    # head's GAN loss) every step, the generator's DMD loss (and GAN term) every --gen_update_ratio steps ->
    # backward, accumulated -> each network's NaN guard, clipping and AdamW step, the generator's EMA -> metrics;
    # saves and grids on their cadence
    for batches in run.steps(nets.generator_train, nets.fake_train, nets.head_train):
        update = run.step % args.gen_update_ratio == 0
        k = generator_step(run.step, args.gen_steps, args.seed)
        lr = run.schedule_lr(optimizers["generator"], args.learning_rate, args.warmup_steps, args.min_lr_ratio)
        for name in ("fake_score", "gan_head"):
            if name in optimizers:
                run.schedule_lr(optimizers[name], args.fake_learning_rate, args.warmup_steps, args.min_lr_ratio)
        losses = run.backward(batches,
                              lambda b: distillation_losses(nets, components, b, run.generator, k, update, args))
        norms = {"fake_grad_norm": run.optimizer_step(optimizers["fake_score"], fake.parameters(),
                                                      losses["fake_score"], args.grad_clip)}
        if head is not None:
            norms["gan_grad_norm"] = run.optimizer_step(optimizers["gan_head"], head.parameters(), losses["gan_d"],
                                                        args.grad_clip)
        if update:
            norms["gen_grad_norm"] = run.optimizer_step(optimizers["generator"], generator.parameters(),
                                                        losses["dmd"] + losses.get("gan_g", 0.0), args.grad_clip, ema)
        run.end_step(export, sample_model, lr=lr, **losses, **norms)


if __name__ == "__main__":
    run_main(main)
