"""Distillation (DMD2): a few-step generator from a trained model, sampled in a few steps without guidance where its
teacher takes many, with classifier-free guidance.

    python trainer/train_distill.py                                   # a few-step student of out/pretrain_tiny
    torchrun --nproc_per_node 2 trainer/train_distill.py --fsdp 1
    python trainer/train_distill.py --from_weight sft --gen_steps 2
    python trainer/train_distill.py --base /models/sd3-medium --from_weight base --preset sd3-medium --data my_images/

Three copies of `--from_weight`: the teacher, frozen and guided; the fake score, which learns the flow loss on the
generator's samples every step; the generator, which learns the distribution-matching loss every
--gen_update_ratio-th step (trainer/distillation.py has the losses). AdamW for both networks; an EMA of the
generator, exported and sampled; the recipe's values are parse_args' set_defaults. Writes out/distill_<preset>.json
(the generator's weights; its record says it samples in its steps with re-noising and no guidance, which
eval/eval_sample.py and eval/eval_geneval.py follow), sample grids in out/samples/ (step 0: the teacher's weights
sampled in the generator's steps), metrics in out/distill_<preset>_metrics.jsonl and the resume checkpoint
checkpoints/distill_<preset>_resume.json. Stop with SIGTERM or Ctrl-C; continue with --from_resume 1.

Read top to bottom: parse_args is the recipe, main the set-up, outputs what the run writes, accumulate the
losses and backward of a step's micro-batches, step_network one network's update, train the loop.
The two files it names: trainer/distillation.py (the losses: distillation_losses, generator_step) and
trainer/trainer_utils.py (everything around the loop: start_run, lr_at the learning rate, save_step
what a save writes and deletes).
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dataset.training_data import stage_data  # noqa: E402
from model.errors import UserError, run_main  # noqa: E402
from model.memory import MemoryPlan, fit_memory  # noqa: E402
from model.model_sd3light import PRESETS, SD3LightConfig  # noqa: E402
from model.precision import StagePrecision, torch_dtype  # noqa: E402
from model.rectified_flow import PREDICTIONS, Sampler  # noqa: E402
from model.token_routing import TokenRouting  # noqa: E402
from model.weights import WeightsExport, check_export, load_components, run_name, weights_identity  # noqa: E402
from trainer.arguments import (  # noqa: E402
    SAVE_DTYPES, StageParser, add_data_args, add_export_args, add_optimizer_args, add_plumbing_args,
    add_routing_args, add_schedule_args, add_validation_args, non_negative_float, positive_float, positive_int,
    probability,
)
from trainer.distillation import (  # noqa: E402
    DistillLearner, DistillRecipe, GANHead, Networks, distillation_flops, distillation_losses, generator_step,
)
from trainer.mechanics.checkpointer import Checkpointer, RunSpec, checkpoint_stem  # noqa: E402
from trainer.mechanics.distributed import (  # noqa: E402
    NamedOptimizerState, any_process, data_parallel, mean_over_processes, sync_gradients, whole,
)
from trainer.mechanics.ema import EMA  # noqa: E402
from trainer.mechanics.metrics import StepRows, Throughput  # noqa: E402
from trainer.mechanics.optimizers import adamw  # noqa: E402
from trainer.mechanics.position import Position  # noqa: E402
from trainer.mechanics.previews import Previews, step_zero  # noqa: E402
from trainer.mechanics.run_lock import hold_run_folders  # noqa: E402
from trainer.mechanics.signals import StopSignal  # noqa: E402
from trainer.networks import load_network, start_weights_source  # noqa: E402
from trainer.trainer_utils import (  # noqa: E402
    NonFiniteSteps, Outputs, finish_run, log_peak, lr_at, not_finite, resume_run, sample_grid, save_step, set_lr,
    start_run, write_steps,
)


def parse_args(argv=None):
    parser = StageParser(__doc__)
    identity, recipe = parser.identity, parser.recipe
    identity.add_argument("--preset", default="tiny", choices=list(PRESETS), help="the size of the teacher's "
                          "weights")
    identity.add_argument("--resolution", type=positive_int, default=32, help="image size the generator draws: the "
                          "side of the square, or the area of the aspect-ratio buckets")
    identity.add_argument("--prediction", default=None, choices=PREDICTIONS, help="must be what the teacher "
                          "predicts (leave it unset: it is read from it)")
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
    add_routing_args(parser)  # token routing of the generator's trained forward (off)
    add_export_args(parser)
    add_data_args(parser)  # caption prefix, repeats, flips, tags, masks; --val_fraction
    add_validation_args(parser)
    add_plumbing_args(parser)
    # The recipe: a fixed number of steps over the built-in captions, AdamW for both networks with weight decay, a
    # warmup and a constant rate after (as DMD2), an EMA of the generator
    parser.set_defaults(num_samples=8000, batch_size=16, accumulation_steps=1, learning_rate=1e-4, weight_decay=0.01,
                        grad_clip=1.0, ema_decay=0.99, seed=0, warmup_steps=50, min_lr_ratio=1.0, epochs=1,
                        max_steps=600, save_interval=200, sample_interval=400, save_dtype="bf16")
    # The real-model recipe, for published SD3 / SD3.5 weights (--preset sd3-medium, sd3.5-medium, sd3.5-large), in
    # place of the demo's; any flag you pass still wins. From DMD2 adapted to SD3.5 in XingtongGe/SenseFlow
    # (configs/SD35/sd35_senseflow.yaml, senseflow/trainer/trainer_sd35_senseflow.py): learning_rate 1e-6 for both
    # networks and no weight decay (lr_max, weight_decay), real_guidance 4 (real_guidance_scale), the generator
    # every 10th step (GD = 10), 4 generator steps, batch 1 at 1024 px, grad_clip 1.0; no EMA, as tianweiy/DMD2
    # trains SD and SDXL (it creates none), which also leaves 4 bytes a parameter off the GPU; as many blocks
    # recomputed in backward as the two trained copies need (auto). Left the demo's: the warmup (SenseFlow warms up
    # over 500 steps of a far longer run), the guidance interval and the run's length. Its GAN term (gan_weight
    # 0.1) stays off: our head does not shard, and the two trained copies of a published model need --fsdp 1
    parser.set_real_model_defaults(learning_rate=1e-6, weight_decay=0.0, real_guidance=4.0, gen_update_ratio=10,
                                   ema_decay=0.0, batch_size=1, resolution=1024,
                                   gradient_checkpointing="auto", log_interval=10)
    return parser.parse_args(argv)


def check_args(args):
    """What argparse cannot check alone: one line each, before any work."""
    if args.gan_weight > 0 and args.fsdp:
        raise UserError("--gan_weight with --fsdp 1 is not supported yet: train the GAN term under DDP")
    if args.guidance_interval[0] >= args.guidance_interval[1]:
        raise UserError("--guidance_interval {:g} {:g} is empty: LOW must be below HIGH (no guidance at all is "
                        "--real_guidance 1)".format(*args.guidance_interval))


def distill_recipe(args, teacher, autocast):
    """The losses' recipe: what --gen_shift, --score_shift and --real_guidance leave unset is the teacher's own
    sampling (its record); the generator's trained forward routed as --route_ratio says (a bad value: one line)."""
    gen_shift = args.gen_shift or teacher["sampling"]["shift"]
    guidance = teacher["sampling"]["cfg"] if args.real_guidance is None else args.real_guidance
    return DistillRecipe(prediction=teacher["prediction"], autocast=autocast, gen_steps=args.gen_steps,
                         gen_shift=gen_shift, score_shift=args.score_shift or gen_shift, real_guidance=guidance,
                         guidance_interval=tuple(args.guidance_interval), min_sigma=args.min_sigma,
                         max_sigma=args.max_sigma, gan_weight=args.gan_weight, gan_d_weight=args.gan_d_weight,
                         routing=TokenRouting.for_model(SD3LightConfig.from_dict(teacher["transformer"]),
                                                        args.route_ratio, args.route_first, args.route_last))


def networks(args, source, info, precision, log, checkpointing):
    """Three copies of the teacher's weights: the teacher frozen (in --frozen_dtype), the generator and the fake
    score trained; the GAN head if --gan_weight; each under DDP or FSDP (the teacher sharded, not wrapped), each
    recomputing `checkpointing` blocks in backward (the memory plan's)."""
    teacher, generator, fake = (load_network(source, role, precision.frozen, info) for role in
                                ("frozen", "trained", "trained"))
    for net in (teacher, generator, fake):
        net.gradient_checkpointing = checkpointing
    log_peak(info, "the weights loaded", log)
    head = GANHead(fake.config.inner_dim).to(info.device) if args.gan_weight > 0 else None
    return Networks(data_parallel(teacher.eval(), info, args.compile, precision.autocast), generator,
                    data_parallel(generator, info, args.compile, precision.autocast), fake,
                    data_parallel(fake, info, args.compile, precision.autocast), head,
                    data_parallel(head, info, False, precision.autocast) if head else None)


def main(argv=None):
    """The set-up as plain calls, one large thing in memory at a time; the run resumed, or started; then the loop
    (train)."""
    args = parse_args(argv)
    check_args(args)
    # The processes, the log, the resume checkpoint asked for (read and verified; None: a fresh run), the precision
    # (cpu_bf16=False: the generator's gradient is the difference of two scores' predictions; bf16 not measured),
    # the seed
    name = run_name("distill", args.preset)
    run = start_run(StagePrecision("distill", cpu_bf16=False, frozen_transformer=True), name, args.run_settings)
    info, metrics, saved, precision = run.info, run.metrics, run.saved, run.precision

    # The teacher's record (its prediction and sampler kept) and components; the data and its cache (the text
    # encoders then freed); the estimate; the networks
    source = start_weights_source(args.from_weight, args.preset, args.prediction, args.out_dir, args.base)
    recipe = distill_recipe(args, source, precision.autocast)
    metrics.log(f"teacher {source['manifest']} (step {source['step']}, predicts {recipe.prediction}, guidance "
                f"{recipe.real_guidance:g} at sigmas in ({recipe.guidance_interval[0]:g}, "
                f"{recipe.guidance_interval[1]:g}]); the generator samples at sigmas {recipe.sigmas()}")
    config = SD3LightConfig.from_dict(source["transformer"])
    components = load_components(source, info.device, torch_dtype(precision.frozen))
    check_export(components, recipe.prediction, args.export_pipeline, args.export_single_file)
    data = stage_data(args.data_settings, components, config, info, args.batch_size, metrics.log)
    if data.dataset is None:  # --cache_only: the cache is built
        return None
    plan = MemoryPlan(("frozen", "trained", "trained"), "adamw", args.ema_decay > 0, args.ema_device,
                      args.batch_size, args.resolution, args.gradient_checkpointing)
    plan = fit_memory(config, plan, components, precision, info, metrics.log)
    nets = networks(args, source, info, precision, metrics.log, plan.checkpointing)

    # AdamW for the generator, the fake score and the GAN head; the generator's EMA is what is exported
    trained = {"generator": nets.generator, "fake_score": nets.fake, "gan_head": nets.head}
    optimizers = {name: adamw(net.parameters(), args.learning_rate, args.weight_decay)
                  for name, net in trained.items() if net is not None}
    ema = EMA(nets.generator, args.ema_decay, args.ema_device) if args.ema_decay > 0 else None
    learner = DistillLearner(nets, optimizers, ema, components, recipe)
    # where the run is in its data, and the schedule: --max_steps, or --epochs (the loop's lr_at reads it)
    position = Position(data.dataset, args.resolution, args.batch_size, args.accumulation_steps, args.seed, info,
                        args.num_workers)
    position.plan(args.max_steps, args.epochs)
    folders = hold_run_folders((args.out_dir, args.save_dir), name, info)  # before the first write: one run of it
    out = outputs(args, info, position, learner, metrics, source, precision)
    resume_run(saved, out, "distill", [p for net in trained.values() if net for p in net.parameters()], info)
    if saved is None:  # step 0: the teacher's weights sampled in the generator's steps
        step_zero(out.previews, metrics, data)
    del saved  # its memory-mapped tensors are the run's own now: the file is not held for the rest of the run
    return train(args, info, position, data, learner, out)


def outputs(args, info, position, learner, metrics, source, precision):
    """What the run writes: the metrics; the resume checkpoint (the position, both networks and the head, their
    optimizers, the EMA, the metrics' wandb id); the generator's EMA (else its weights), recording how it samples
    (its steps, re-noised, without guidance) and what it was distilled from (`source`); sample grids and the
    validation loss of those weights."""
    name, nets, ema, recipe = metrics.name, learner.nets, learner.ema, learner.recipe
    sampling, teacher = {"steps": recipe.gen_steps, "cfg": 1.0, "shift": recipe.gen_shift, "renoise": True}, \
        weights_identity(source, args.out_dir)
    export = WeightsExport(os.path.join(args.out_dir, name), nets.generator, learner.components, {
        "stage": "distill", "preset": args.preset, "resolution": args.resolution, "prediction": recipe.prediction,
        "ema": ema is not None, "save_dtype": args.save_dtype, "transformer": nets.generator.config.to_dict(),
        "components": learner.components.spec, "sampling": sampling, "teacher": teacher,
        "teacher_sampling": source["sampling"], "generator_sigmas": recipe.sigmas(), "args": vars(args)},
        SAVE_DTYPES[args.save_dtype], args.export_pipeline, args.export_single_file)
    spec = RunSpec("distill", {"kind": "distill", "teacher": teacher}, vars(args), args.resume_kinds, {
        "prediction": recipe.prediction, **precision.as_args(), "gen_shift": recipe.gen_shift,
        "score_shift": recipe.score_shift, "real_guidance": recipe.real_guidance,
        "fake_learning_rate": args.fake_learning_rate or args.learning_rate})
    trained = {"generator": nets.generator, "fake_score": nets.fake, "gan_head": nets.head}
    checkpointer = Checkpointer(checkpoint_stem(args.save_dir, name), info, spec, position, {
        **trained, "ema": ema, **{f"{name}_optimizer": NamedOptimizerState(net, learner.optimizers[name])
                                  if net is not None else None for name, net in trained.items()}, "metrics": metrics})
    sampler = Sampler(args.resolution, **sampling, prediction=recipe.prediction, autocast=precision.autocast)
    previews = Previews(nets.generator, ema, learner.components, sampler, args.seed, info,
                        os.path.join(args.out_dir, "samples", name))
    throughput, line = Throughput.of_model(nets.generator, learner.components, recipe.routing, None, info.device,
                                           precision.autocast)
    metrics.log(line)
    return Outputs(metrics, previews, checkpointer, export, throughput)


def accumulate(args, batches, learner, generator, k, update, throughput):
    """The step's micro-batches: each network's losses of each (the generator drawing from its step k, with
    gradients on `update` steps), their sum backpropagated scaled so that the gradients accumulate to their mean
    (each loss reaches its own network; DDP all-reduces them in the last one's backward) -> the sum of each loss,
    and their FLOPs."""
    totals, flops, nets = {}, 0.0, learner.nets
    for micro, batch in enumerate(batches):
        for net in (nets.generator_train, nets.fake_train, nets.head_train):
            sync_gradients(net, micro == args.accumulation_steps - 1)
        losses = distillation_losses(nets, learner.components, batch, generator, k, update, learner.recipe)
        (sum(losses.values()) / args.accumulation_steps).backward()
        # on the device: read at the log step, after the all-reduce
        totals = {name: totals.get(name, 0.0) + value.detach().double() for name, value in losses.items()}
        flops += distillation_flops(throughput, batch, k, update, learner.recipe, nets.head is not None)
    return totals, flops


def step_network(args, net, optimizer, loss):
    """One network's update, on the device: its gradients clipped, its optimizer's step (none where the loss or the
    gradient norm is not finite: `optimizer.found_inf`), its gradients zeroed -> the gradient norm (a tensor)."""
    grad_norm = whole(torch.nn.utils.clip_grad_norm_(net.parameters(), args.grad_clip))
    optimizer.found_inf = not_finite(loss, grad_norm)  # fused AdamW: no update where 1
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def train(args, info, position, data, learner, out):
    """The loop, from `position` (resumed, or at the start) to the end of the schedule or a stop signal. Between two
    log steps (--log_interval) nothing is read to the host: a GPU runs ahead."""
    nets, opt, ema = learner.nets, learner.optimizers, learner.ema
    stopping, guard, rows = False, NonFiniteSteps(args.save_dir), StepRows()
    with StopSignal() as stop:  # SIGTERM or Ctrl-C: saved at the next log step's end, and the loop ends
        while not (position.finished or stopping):
            started, batches = time.perf_counter(), position.next_step()  # step + 1: this rank's micro-batches
            update_generator = position.step % args.gen_update_ratio == 0  # the generator learns every Nth step
            k = generator_step(position.step, learner.recipe.gen_steps, args.seed)  # it draws from its step k
            lr = set_lr(opt["generator"], lr_at(position.progress, position.plan_steps, args.learning_rate,
                                                args.warmup_steps, args.min_lr_ratio))
            set_lr([opt[n] for n in ("fake_score", "gan_head") if n in opt], lr_at(
                position.progress, position.plan_steps, args.fake_learning_rate or args.learning_rate,
                args.warmup_steps, args.min_lr_ratio))
            totals, flops = accumulate(args, batches, learner, position.generator, k, update_generator,
                                       out.throughput)
            # the losses over micro-batches and processes, in one all-reduce on the device
            means = mean_over_processes(torch.stack(list(totals.values())) / args.accumulation_steps, info)
            losses = dict(zip(totals, means.unbind()))
            # each network clipped and stepped on the device (the fake score and the head every step, the generator
            # on its steps), skipped where its loss or gradient norm is not finite: the guard reads both at the log
            # step, in this order
            stepped = [("fake_grad_norm", nets.fake, opt["fake_score"], losses["fake_score"])]
            if nets.head is not None:
                stepped.append(("gan_grad_norm", nets.head, opt["gan_head"], losses["gan_d"]))
            if update_generator:
                stepped.append(("gen_grad_norm", nets.generator, opt["generator"],
                                losses["dmd"] + losses.get("gan_g", 0.0)))
            norms = {name: step_network(args, net, optimizer, loss) for name, net, optimizer, loss in stepped}
            if update_generator and ema is not None:
                ema.update(position.step, opt["generator"].found_inf)  # not where the generator's step was skipped
            position.end_step()
            rows.add(position, {"lr": lr, **losses, **norms, "val_loss": None},
                     [(loss, norms[name]) for name, _, _, loss in stepped], flops, started,
                     position.step_ids() if args.log_sample_ids else None)

            saving = position.due(args.save_interval)
            validating = data.validation and position.due(args.val_interval)
            if saving or validating or position.step % args.log_interval == 0 or stop.received and info.world_size == 1:
                # a log step, where the host reads; processes agree to stop here (one alone stops at once)
                stopping = any_process(stop.received is not None, info)
                # every step's values since the last log step read at once, the validation loss on the last if
                # due; each step's row, or the warnings of the networks skipped as not finite (many: the end)
                write_steps(rows, guard, out, data.validation if validating else None, position.global_batch)
            if saving or stopping:
                # the resume checkpoint, then what other tools read (the generator's EMA, else its weights); older
                # ones deleted
                save_step(out, ema or nets.generator, position, info, stopping)
            if position.due(args.sample_interval) and not stopping:
                sample_grid(out, position.step, data.prompts)
    return finish_run(out, learner.components, info, stopping, stop.received)


if __name__ == "__main__":
    run_main(main)
