"""LoRA: train small low-rank adapters on a frozen model, e.g. to teach it one subject, style or word.

    python trainer/train_lora.py                      # the demo: teach out/pretrain_tiny the word "white"
    python trainer/train_lora.py --data my_images/ --lora_name mystyle --lora_rank 16
    python trainer/train_lora.py --base /models/sd3-medium --from_weight base --preset sd3-medium --data my_images/
    torchrun --nproc_per_node 2 trainer/train_lora.py --data my_images/ --lora_targets attention,ff

It trains the pretraining loss (model/rectified_flow.py) through adapters (--lora_rank, --lora_targets) on the
frozen `--from_weight`, with AdamW on the adapters only; the recipe's values are parse_args' set_defaults. The
demo's data (`--data builtin:white`) is built-in images whose objects are all white, a colour (and a word) the
pretrained model never saw, trained alongside ordinary ones (`--prior_data`) so that what the model drew before
changes less. The adapters go to out/lora/lora_<name>_<preset>.safetensors in diffusers' LoRA format (rank, alpha
and targets in its metadata, plus which base weights they were trained on), sample grids to out/samples/ (step 0
shows the base model), the resume checkpoint (only the adapters, their optimizer and EMA) to
checkpoints/lora_<name>_<preset>_resume.json. Sample with the adapter:

    python eval/eval_sample.py --lora demo --prompt "a large white star in the center"

Read top to bottom: parse_args is the recipe, main the set-up, outputs what the run writes, accumulate the
loss and backward of a step's micro-batches, train the loop.
The two files it names: model/rectified_flow.py (the loss: flow_inputs and flow_loss_of, and the sigmas, noise and
velocity target it uses) and trainer/trainer_utils.py (everything around the loop: start_run, lr_at the learning
rate, save_step what a save writes and deletes).
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dataset.training_data import stage_data, training_dataset  # noqa: E402
from model.block_swap import swap_request  # noqa: E402
from model.errors import run_main  # noqa: E402
from model.memory import MemoryPlan, fit_memory  # noqa: E402
from model.model_lora import (  # noqa: E402
    ADAPTER_KINDS, Adapter, LoRAExport, LoRAWeights, lora_layers, lora_parameters, resolve_targets,
)
from model.model_sd3light import PRESETS, SD3LightConfig  # noqa: E402
from model.precision import StagePrecision, torch_dtype  # noqa: E402
from model.rectified_flow import PREDICTIONS, FlowRecipe, Sampler, flow_loss_of  # noqa: E402
from model.token_routing import TokenRouting  # noqa: E402
from model.weights import load_components, lora_file, lora_run_name, weights_identity  # noqa: E402
from trainer.arguments import (  # noqa: E402
    SAVE_DTYPES, StageParser, add_adapter_args, add_block_swap_args, add_data_args, add_flow_args, add_graph_args,
    add_optimizer_args, add_plumbing_args, add_routing_args, add_sampling_args, add_schedule_args,
    add_validation_args, positive_int,
)
from trainer.mechanics.checkpointer import Checkpointer, RunSpec, checkpoint_stem  # noqa: E402
from trainer.mechanics.distributed import (  # noqa: E402
    NamedOptimizerState, any_process, average_gradients, clip_grad_norm_mixed, data_parallel, mean_over_processes,
    sync_gradients,
)
from trainer.mechanics.ema import EMA  # noqa: E402
from trainer.mechanics.metrics import StepRows, Throughput  # noqa: E402
from trainer.mechanics.optimizers import adamw  # noqa: E402
from trainer.mechanics.position import Position  # noqa: E402
from trainer.mechanics.previews import Previews, step_zero  # noqa: E402
from trainer.mechanics.run_lock import hold_run_folders  # noqa: E402
from trainer.mechanics.signals import StopSignal  # noqa: E402
from trainer.networks import (  # noqa: E402
    adapted_frozen, adapter_count, start_weights_source, text_adapters, text_modules, text_optimizer,
)
from trainer.trainer_utils import (  # noqa: E402
    FlowLearner, NonFiniteSteps, Outputs, finish_run, log_peak, lr_at, not_finite, resume_run, run_graphs,
    sample_grid, save_step, set_lr, start_run, step_inputs, write_steps,
)


def parse_args(argv=None):
    parser = StageParser(__doc__)
    identity, recipe = parser.identity, parser.recipe
    identity.add_argument("--preset", default="tiny", choices=list(PRESETS), help="the size of the base weights")
    identity.add_argument("--resolution", type=positive_int, default=32, help="training image size: the side of the "
                          "square, or the area of the aspect-ratio buckets")
    identity.add_argument("--prediction", default=None, choices=PREDICTIONS, help="must be what the base weights "
                          "predict (leave it unset: it is read from them)")
    identity.add_argument("--lora_name", default="demo", help="names the file: "
                          "out/lora/lora_<name>_<preset>.safetensors")
    recipe.add_argument("--from_weight", default="pretrain", help="base weights: a stage name in --out_dir "
                        "('pretrain' = pretrain_<preset>, 'sft' = sft_<preset>), the path of a weights manifest or "
                        "of a diffusers folder, or 'base' = --base's transformer")
    recipe.add_argument("--prior_data", default="auto", help="images trained alongside --data so the model keeps "
                        "what it already draws (DreamBooth's prior preservation): a dataset as for --data, 'none', or "
                        "'auto' = the built-in shapes when --data is built-in (the demo), none for your own data")
    recipe.add_argument("--prior_samples", type=positive_int, default=120, help="size of a built-in prior dataset")
    add_adapter_args(parser)  # LoRA, DoRA or LoKr: rank, alpha, dropout, targets
    add_optimizer_args(parser)  # batch, learning rate, weight decay, clipping, EMA, seed
    add_schedule_args(parser)  # warmup, cosine decay, epochs or max steps
    add_flow_args(parser)  # sigmas, loss, weighting, caption dropout
    add_routing_args(parser)  # token routing (off)
    add_block_swap_args(parser)  # the first blocks streamed from host memory (off)
    add_graph_args(parser)  # the step as a CUDA graph (auto: off for now)
    add_sampling_args(parser)
    add_data_args(parser)  # caption prefix, repeats, flips, tags, masks; --val_fraction
    add_validation_args(parser)
    add_plumbing_args(parser, data="builtin:white")
    # The recipe: many epochs of the small demo data with its prior data, AdamW at a high rate (adapters take one)
    # with a short warmup and a cosine decay, no EMA (over so few steps) and no caption dropout; fp32 files (adapters
    # are small, and diffusers applies them exactly), a grid at the end only
    parser.set_defaults(num_samples=40, batch_size=16, accumulation_steps=1, learning_rate=2e-3, weight_decay=0.0,
                        grad_clip=1.0, ema_decay=0.0, seed=0, warmup_steps=10, min_lr_ratio=0.1, epochs=30,
                        max_steps=0, sigma_scheme="logit_normal", logit_mean=0.0, logit_std=1.0, train_shift=1.0,
                        loss="mse", weighting="none", caption_dropout=0.0, save_interval=100, sample_interval=0,
                        save_dtype="fp32")
    # The real-model recipe, for published SD3 / SD3.5 weights (--preset sd3-medium, sd3.5-medium, sd3.5-large), in
    # place of the demo's; any flag you pass still wins. Where each value comes from:
    #   learning_rate 1e-4, lora_rank 16: kohya sd-scripts docs/sd3_train_network.md (network_dim=16,
    #     learning_rate=1e-4) and SimpleTuner's SD3 quickstart (learning_rate=1e-4; --lora_rank 16 by default);
    #     alpha = rank (scale 1, our default) as diffusers' train_dreambooth_lora_sd3.py (lora_alpha=args.rank)
    #   batch_size 1, accumulation_steps 4, constant rate without warmup, max_steps 500: diffusers'
    #     examples/dreambooth/README_sd3.md LoRA command (train_batch_size=1, gradient_accumulation_steps=4,
    #     lr_scheduler constant, lr_warmup_steps 0, max_train_steps 500); weight_decay 1e-4: its --adam_weight_decay
    #   resolution 1024: diffusers' and SimpleTuner's SD3 examples (1024 px, SD3.5's own); they checkpoint every
    #     block, auto recomputes only as many as the card needs (none at batch 1 on 16 GB and up: half the step)
    #   logit-normal sigmas (0, 1) shifted by 3: diffusers' --weighting_scheme logit_normal draws its timesteps
    #     from the model's scheduler, shift 3.0 in SD3.5's scheduler_config (SimpleTuner's flow_schedule_shift 3)
    #   sample_interval 100: no anchor; a grid every fifth of the run, to watch it learn
    #   blocks_to_swap auto: none where the card holds the run (recomputation is spent first), else the fewest
    #     blocks that make it fit (kohya's --blocks_to_swap, counted by hand there)
    parser.set_real_model_defaults(learning_rate=1e-4, lora_rank=16, batch_size=1, accumulation_steps=4,
                                   warmup_steps=0, min_lr_ratio=1.0, max_steps=500, weight_decay=1e-4,
                                   gradient_checkpointing="auto", resolution=1024, train_shift=3.0,
                                   sample_interval=100, blocks_to_swap="auto", log_interval=10)
    return parser.parse_args(argv)


def prior_dataset(args, settings, components, config, log):
    """--prior_data (auto: the built-in shapes for built-in --data, none for yours), or None."""
    prior = args.prior_data if args.prior_data != "auto" else "builtin" if args.data.startswith("builtin") \
        else "none"
    if prior == "none":
        return None
    dataset = training_dataset(settings, components, config.patch_size, log, data=prior,
                               num_samples=args.prior_samples)
    log(f"prior preservation: the {len(dataset)} samples of {prior} train alongside {args.data}")
    return dataset


def memory_plan(args, config):
    """What the memory estimate weighs (model/memory.py): the adapters on a frozen transformer of `config` (a bad
    --lora_targets: one line), AdamW on them, the EMA, one micro-batch, and the blocks swapped (--fsdp 1: one line)."""
    adapters = adapter_count(config, args.lora_targets, args.lora_rank, args.lora_alpha,
                             Adapter(args.adapter, args.lokr_factor))
    return MemoryPlan((adapters,), "adamw", args.ema_decay > 0, args.ema_device, args.batch_size, args.resolution,
                      args.gradient_checkpointing,
                      blocks_to_swap=swap_request(args.blocks_to_swap, bool(args.fsdp), None, config.num_layers))


def main(argv=None):
    """The set-up as plain calls, one large thing in memory at a time; the run resumed, or started; the loop."""
    args = parse_args(argv)
    # The processes, the log, the resume checkpoint asked for (read and verified; None: a fresh run), the precision
    # and the seed (the same adapter initialisation on every rank)
    name = lora_run_name(args.lora_name, args.preset)
    run = start_run(StagePrecision("lora", frozen_transformer=True), name, args.run_settings)
    info, metrics, saved, precision = run.info, run.metrics, run.saved, run.precision

    # The base weights' record and components; the data (the prior data beside it) and its cache; the estimate
    source = start_weights_source(args.from_weight, args.preset, args.prediction, args.out_dir, args.base)
    prediction, config = source["prediction"], SD3LightConfig.from_dict(source["transformer"])
    # the token routing and the memory plan, checked now: a bad value is one line before any work
    routing = TokenRouting.for_model(config, args.route_ratio, args.route_first, args.route_last)
    plan = memory_plan(args, config)
    components = load_components(source, info.device, torch_dtype(precision.frozen))
    text = text_adapters(components, args.train_text_encoders, args.lora_rank, args.lora_alpha,
                         metrics.log)  # LoRA on the text encoders that train (none by default): encoded each step
    prior = prior_dataset(args, args.data_settings, components, config, metrics.log)
    data = stage_data(args.data_settings, components, config, info, args.batch_size, metrics.log, prior)
    if data.dataset is None:  # --cache_only: the cache is built
        return None
    plan = fit_memory(config, plan, components, precision, info, metrics.log)
    model = adapted_frozen(source, precision.frozen, info, plan.blocks_to_swap,
                           (args.lora_targets, args.lora_rank, args.lora_alpha, args.lora_dropout,
                            Adapter(args.adapter, args.lokr_factor)), metrics.log)  # the frozen base, adapted
    model.gradient_checkpointing = plan.checkpointing
    log_peak(info, "the weights loaded", metrics.log)
    metrics.log(f"{ADAPTER_KINDS[args.adapter]} rank {args.lora_rank}, alpha {args.lora_alpha or args.lora_rank:g} on "
                f"{len(lora_layers(model))} layers of {source['manifest']} (step {source['step']}, frozen in "
                f"{precision.frozen})")

    # DDP, or FSDP shards (--fsdp 1: the frozen base sharded too); then only the adapters train, with AdamW (the
    # text encoders' with one of their own, at --text_encoder_lr); the resume checkpoint and the EMA hold them alone
    train_model = data_parallel(model, info, args.compile, precision.autocast)
    optimizers = [adamw([p for p in model.parameters() if p.requires_grad], args.learning_rate, args.weight_decay)]
    optimizers += [text_optimizer(text, args.learning_rate, args.text_encoder_lr, args.weight_decay)] if text else []
    ema = EMA(LoRAWeights(model, text), args.ema_decay, args.ema_device) if args.ema_decay > 0 else None
    recipe = FlowRecipe(prediction=prediction, sigma_scheme=args.sigma_scheme, logit_mean=args.logit_mean,
                        logit_std=args.logit_std, train_shift=args.train_shift, loss=args.loss,
                        weighting=args.weighting, caption_dropout=args.caption_dropout, autocast=precision.autocast,
                        routing=routing)
    graphs = run_graphs(args.cuda_graph, info, model, routing, False, metrics.log)  # or one line
    learner = FlowLearner(model, train_model, optimizers, ema, components, recipe, graphs, text)
    # where the run is in its data, and the schedule: --max_steps, or --epochs (the loop's lr_at reads it)
    position = Position(data.dataset, args.resolution, args.batch_size, args.accumulation_steps, args.seed, info,
                        args.num_workers)
    position.plan(args.max_steps, args.epochs)
    folders = hold_run_folders((args.out_dir, args.save_dir), name, info)  # before the first write: one run of it
    out = outputs(args, info, position, learner, metrics, source, precision)
    resume_run(saved, out, "lora", LoRAWeights(model, text).state_dict().values(), info)  # a misfit: one line
    if saved is None:  # step 0: the starting weights' grid and validation loss, to compare with
        step_zero(out.previews, metrics, data)
    del saved  # its memory-mapped tensors are the run's own now: the file is not held for the rest of the run
    return train(args, info, position, data, learner, out)


def outputs(args, info, position, learner, metrics, source, precision):
    """What the run writes: the metrics; the resume checkpoint (the position, the adapters, their optimizer, their
    EMA, the metrics' wandb id); the adapters (their EMA if on) in diffusers' LoRA format, naming the base
    (`source`); sample grids and the validation loss of the model with them."""
    name, model, ema, components, prediction = metrics.name, learner.model, learner.ema, learner.components, \
        learner.recipe.prediction
    sampling, base = {"steps": args.sample_steps, "cfg": args.sample_cfg, "shift": args.sample_shift}, \
        weights_identity(source, args.out_dir)
    export = LoRAExport(lora_file(args.out_dir, args.lora_name, args.preset), model, {
        "stage": "lora", "preset": args.preset, "resolution": args.resolution, "prediction": prediction,
        "ema": ema is not None, "save_dtype": args.save_dtype, "transformer": model.config.to_dict(),
        "components": components.spec, "sampling": sampling, "base": base, "args": vars(args)},
        SAVE_DTYPES[args.save_dtype], learner.text)
    spec = RunSpec("lora", {"kind": "lora", "base": base}, vars(args), args.resume_kinds,
                   {"prediction": prediction, **precision.as_args()})
    checkpointer = Checkpointer(checkpoint_stem(args.save_dir, name), info, spec, position, {
        "model": LoRAWeights(model, learner.text), "optimizer": NamedOptimizerState(model, learner.optimizers[0]),
        "text_optimizer": NamedOptimizerState(text_modules(learner.text), learner.optimizers[-1]) if learner.text
        else None, "ema": ema, "metrics": metrics})
    sampler = Sampler(args.resolution, **sampling, prediction=prediction, autocast=precision.autocast)
    previews = Previews(model, ema, components, sampler, args.seed, info, os.path.join(args.out_dir, "samples", name))
    throughput, line = Throughput.of_model(model, components, learner.recipe.routing,
                                           (args.lora_rank, resolve_targets(args.lora_targets)), info.device,
                                           precision.autocast)
    metrics.log(line)
    return Outputs(metrics, previews, checkpointer, export, throughput)


def accumulate(args, inputs, learner, info):
    """The step's micro-batches (flow_inputs each): the flow loss of each, backpropagated scaled so that the
    gradients accumulate to their mean (DDP all-reduces them in the last one's backward, the text encoders' after
    it) -> the sum of their losses, on the device."""
    total = 0.0
    for micro, batch in enumerate(inputs):
        sync_gradients(learner.train_model, micro == args.accumulation_steps - 1)
        loss = flow_loss_of(learner.train_model, batch, learner.recipe)
        (loss / args.accumulation_steps).backward()
        total = total + loss.detach().double()  # on the device: read at the log step, after the all-reduce
    average_gradients([p for encoder in learner.text.values() for p in lora_parameters(encoder)], info)
    return total


def train(args, info, position, data, learner, out):
    """The loop, from `position` to the end of the schedule or a stop signal. Between two log steps (--log_interval)
    nothing is read to the host; with --cuda_graph 1 each shape's step is captured at its third and replayed after."""
    log, ema, adapters = out.metrics.log, learner.ema, LoRAWeights(learner.model, learner.text)
    params = [p for optimizer in learner.optimizers for g in optimizer.param_groups for p in g["params"]]  # adapters
    stopping, guard, rows = False, NonFiniteSteps(args.save_dir), StepRows()
    graphs = learner.graphs.prepare(learner.optimizers)  # after the resume: its rates in tensors a graph reads
    with StopSignal() as stop:  # SIGTERM or Ctrl-C: saved at the next log step's end, and the loop ends
        while not (position.finished or stopping):
            started, batches = time.perf_counter(), position.next_step()  # step + 1: this rank's micro-batches
            lr = set_lr(learner.optimizers, lr_at(position.progress, position.plan_steps, args.learning_rate,
                                                  args.warmup_steps, args.min_lr_ratio))
            training_text = not args.text_encoder_steps or position.step <= args.text_encoder_steps  # (0: all)
            inputs, flops = step_inputs(batches, learner, position.generator, out.throughput, training_text)
            if not graphs.captured(inputs):  # eager; or, at a shape's third step with --cuda_graph 1, captured
                with graphs.recording(inputs) as recorded:
                    total = accumulate(args, recorded, learner, info)  # the loss and backward of each micro-batch
                    # the loss over micro-batches and processes, the gradients' norm (then clipped), and whether
                    # either is not finite: all on the device, where the update and the EMA are skipped if so
                    loss = mean_over_processes(total / args.accumulation_steps, info)
                    # (torch's clip_grad_norm_, where FSDP's sharded adapters train beside the text encoders' whole)
                    grad_norm = clip_grad_norm_mixed(params, args.grad_clip)
                    skipped = not_finite(loss, grad_norm)
                    for optimizer in learner.optimizers:
                        optimizer.found_inf = skipped  # fused AdamW: no update where 1
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
                    graphs.outputs(loss, grad_norm, skipped)
            loss, grad_norm, skipped = graphs.run(inputs)  # a captured step replayed on these inputs
            if ema is not None:
                ema.update(position.step, skipped)
            position.end_step()
            rows.add(position, {"loss": loss, "lr": lr, "grad_norm": grad_norm, "val_loss": None}, [(loss, grad_norm)],
                     flops, started, position.step_ids() if args.log_sample_ids else None)

            saving = position.due(args.save_interval)
            validating = data.validation and position.due(args.val_interval)
            if saving or validating or position.step % args.log_interval == 0 or stop.received and info.world_size == 1:
                # a log step, where the host reads; processes agree to stop here (one alone stops at once)
                stopping = any_process(stop.received is not None, info)
                # every step's values since the last log step read at once, the validation loss on the last if
                # due; each step's row, or the warning of one skipped as not finite (many in a row: the end)
                write_steps(rows, guard, out, data.validation if validating else None, position.global_batch)
            if saving or stopping:
                # the resume checkpoint, then the LoRA file (the EMA's adapters, else their own); older ones deleted
                save_step(out, ema or adapters, position, info, stopping)
            if position.due(args.sample_interval) and not stopping:
                sample_grid(out, position.step, data.prompts)
    finish_run(out, learner.components, info, stopping, stop.received)
    if position.finished:
        log(f"sample with the adapter: python eval/eval_sample.py --lora {args.lora_name} --prompt \"...\"")
    return position.step


if __name__ == "__main__":
    run_main(main)
