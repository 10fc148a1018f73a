"""A stage's command line. The stage script declares its own hyperparameters, each in the group that says how a
resume treats it (the group is where the argument is declared, and what --help shows it under):

    identity  what the run is (preset, resolution, data, prediction...): resuming with another value is refused
    recipe    how it trains (learning rate, batch, loss...): another value on resume needs --force_resume 1
    length    how long it trains (--epochs, --max_steps): a change that ends the schedule later continues the
              run; one that ends it earlier is a recipe change
    free      what changes nothing that is trained (sampling, intervals): free to change on resume

This module gives those groups (StageParser), the checked number types every declaration uses, so a bad value
is one line naming the argument, and the argument groups several stages share. A shared group declares the
training recipe (batch, learning rate, schedule, loss, intervals) without values: each stage writes them once,
in its parse_args' set_defaults, and the parser refuses a stage that leaves one unset or sets one twice. A
fine-tune stage also writes its real-model recipe (set_real_model_defaults): the values that replace the demo's
when its weights are a published SD3 / SD3.5 model's (--preset one of PUBLISHED_PRESETS, with --base's SD3
components); a flag given on the command line wins over either, and args.recipe_note says which recipe is in
force. The
plumbing every stage shares and nobody tunes (--base, --data, paths, resume, cache, workers, dtype, sharding,
wandb) keeps its one value here.
"""
import argparse
import dataclasses
import math
import re
import os
import sys

import torch

from dataset.training_data import DataSettings
from model.model_lora import ADAPTER_KINDS, TARGET_GROUPS
from model.model_sd3light import PUBLISHED_PRESETS
from model.rectified_flow import LOSSES, WEIGHTINGS
from model.precision import FROZEN_DTYPES
from model.weights import DEFAULT_OUT_DIR, REPO_ROOT
from trainer.trainer_utils import RunSettings

DEFAULT_SAVE_DIR = os.path.join(REPO_ROOT, "checkpoints")
DEFAULT_CACHE_DIR = os.path.join(REPO_ROOT, "cache")
SAVE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
RESUME_KINDS = {"identity": "what the run is (a resume must match)",
                "recipe": "how it trains (changing one on resume needs --force_resume 1)",
                "length": "how long it trains (a resume may make it longer)",
                "free": "free to change on resume"}


class ResumeGroup:
    """An argument group of one resume kind: add_argument as argparse's, recording each argument's kind, and which
    arguments are declared without a value for the stage to give (`stage_sets`)."""

    def __init__(self, parser, kind):
        self.group, self.kind, self.parser = parser.add_argument_group(RESUME_KINDS[kind]), kind, parser

    def add_argument(self, *names, stage_sets=False, **kwargs):
        action = self.group.add_argument(*names, **kwargs)
        self.parser.resume_kinds[action.dest] = self.kind
        if stage_sets:
            self.parser.stage_sets.add(action.dest)
        return action


class StageParser(argparse.ArgumentParser):
    """The parser of a stage script: its docstring as the description, the four resume groups, and errors in one
    line (`error: argument --batch_size: ...`, exit code 2) instead of the usage block."""

    def __init__(self, doc):
        super().__init__(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
        self.resume_kinds = {}  # argument name -> identity | recipe | length | free
        self.stage_sets = set()  # the shared arguments whose value the stage writes (set_defaults)
        self.identity, self.recipe = ResumeGroup(self, "identity"), ResumeGroup(self, "recipe")
        self.length, self.free = ResumeGroup(self, "length"), ResumeGroup(self, "free")
        self.real_model = {}  # the stage's recipe for published weights (set_real_model_defaults)

    def set_defaults(self, **values):
        """The stage's recipe: values for the shared arguments declared without one, each written once (an
        argument that has its value where it is declared is not set again here)."""
        twice = sorted(name for name in values if name not in self.stage_sets)
        if twice:
            raise ValueError(f"{', '.join(twice)} already have their value where they are declared")
        super().set_defaults(**values)

    def set_real_model_defaults(self, **values):
        """The stage's recipe for a published model's weights: the values that replace the demo's (declared ones or
        its set_defaults) when --preset is one of PUBLISHED_PRESETS and --base gives SD3 components. Only arguments
        the stage has; --help lists them."""
        declared = {action.dest for action in self._actions}
        unknown = sorted(name for name in values if name not in declared)
        if unknown:
            raise ValueError(f"the real-model recipe sets {', '.join(unknown)}, which the stage does not declare")
        self.real_model = values
        self.epilog = (f"With --base and --preset {', '.join(PUBLISHED_PRESETS)} (published weights), the real-model "
                       f"recipe replaces the demo's defaults: {shown_values(values)}; a flag given still wins.")

    def parse_known_args(self, argv=None, namespace=None):
        """The arguments, with the real-model recipe's defaults where --preset names published weights. The
        namespace carries the arguments' resume kinds, the recipe in force and what they say of the data (a
        DataSettings filled from the options its fields name) and of its start (a RunSettings) as class
        attributes (args.resume_kinds, args.recipe_note, args.data_settings, args.run_settings), so they go
        wherever the arguments go without being one of them (vars(args) leaves them out)."""
        unset = sorted(name for name in self.stage_sets if self.get_default(name) is None)
        if unset:
            raise ValueError(f"the stage gives no value to {', '.join(unset)} (its set_defaults)")
        if namespace is not None:
            raise ValueError("a stage parses its arguments into a namespace of its own (StageParser.namespace)")
        demo_note = "the demo's recipe (parse_args' set_defaults)" + (
            f"; --base with --preset {', '.join(PUBLISHED_PRESETS)} takes the real-model one" if self.real_model
            else "")
        args, rest = super().parse_known_args(argv, self.namespace(demo_note))
        if self.real_model and getattr(args, "preset", None) in PUBLISHED_PRESETS and getattr(args, "base", None):
            demo = {name: self.get_default(name) for name in self.real_model}
            super().set_defaults(**self.real_model)  # a fresh parse: the flags given still win over these
            try:
                args, rest = super().parse_known_args(argv, self.namespace(None))
            finally:
                super().set_defaults(**demo)
            in_force = {name: getattr(args, name) for name in self.real_model}
            type(args).recipe_note = real_model_note(args.preset, in_force, self.real_model)
        given = vars(args)
        if given.get("fsdp") and given.get("ema_device") == "cpu":  # its shards would keep a GPU mesh: refused
            self.error("--ema_device cpu does not go with --fsdp 1: FSDP shards the EMA like the weights (1/N of it "
                       "on each GPU) and gathers it there; leave --ema_device auto")
        adapter = given.get("adapter", "lora")
        if adapter == "dora" and given.get("frozen_dtype") == "int8":
            self.error("--adapter dora renormalises the base weight's columns, which int8 weights do not hold "
                       "exactly: use --frozen_dtype bf16, or --adapter lora")
        if adapter != "lora" and given.get("lora_rank") == 0:  # Flow-DPO's 0: all weights tune, no adapter
            self.error(f"--adapter {adapter} trains adapters: give their --lora_rank too (0 tunes all weights)")
        self.check_text_encoders(given)
        type(args).data_settings = filled(DataSettings, given)
        type(args).run_settings = filled(RunSettings, {**given, "recipe_note": args.recipe_note,
                                                       "arguments": dict(given)})
        return args, rest

    def check_text_encoders(self, given):
        """One line for what --train_text_encoders does not go with."""
        names, lrs = given.get("train_text_encoders") or (), given.get("text_encoder_lr")
        if not names and (lrs is not None or given.get("text_encoder_steps")):
            self.error("--text_encoder_lr and --text_encoder_steps are for the encoders --train_text_encoders names: "
                       "name them (clip_l,clip_g; text on the tiny model)")
        if len(set(names)) < len(names):
            self.error(f"--train_text_encoders {','.join(names)} names an encoder twice")
        if lrs is not None and len(lrs) not in (1, len(names)):
            self.error(f"--text_encoder_lr takes one rate or one per encoder of --train_text_encoders "
                       f"({len(names)}), got {len(lrs)}")
        if names and given.get("cuda_graph") == "1":
            self.error("--cuda_graph 1 captures a step from cached text: leave --train_text_encoders empty, or use "
                       "--cuda_graph 0")

    def namespace(self, recipe_note):
        return type("StageArgs", (argparse.Namespace,), {"resume_kinds": self.resume_kinds,
                                                         "recipe_note": recipe_note})()

    def error(self, message):
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def filled(settings, given):
    """The frozen settings dataclass `settings` with each field the value of the option of its name in `given`
    (the parsed options, by name); a field no option names keeps its default."""
    return settings(**{f.name: given[f.name] for f in dataclasses.fields(settings) if f.name in given})


def shown_values(values, recipe=None):
    """`name value, ...` of `values`; with `recipe`, each value that differs from its marked "(your flag)"."""
    shown = []
    for name, value in values.items():
        text = f"{name} {value:g}" if isinstance(value, float) else f"{name} {value}"
        shown.append(text + (" (your flag)" if recipe is not None and value != recipe[name] else ""))
    return ", ".join(shown)


def real_model_note(preset, in_force, recipe):
    """The log line that names the real-model recipe and its values in force (`in_force`), marking those a flag
    changed from `recipe`'s."""
    return f"the real-model recipe (--preset {preset} is published weights): {shown_values(in_force, recipe)}"


# ----------------------------------------------------------------------------------------------------------------
# Checked numbers: argparse names the argument and the value in its one-line error


def checked(kind, test, what):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not test(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value
    return parse


positive_int = checked(int, lambda v: v >= 1, "a whole number >= 1")
non_negative_int = checked(int, lambda v: v >= 0, "a whole number >= 0")
positive_float = checked(float, lambda v: v > 0 and not math.isnan(v), "a number > 0")
non_negative_float = checked(float, lambda v: v >= 0 and not math.isnan(v), "a number >= 0")
finite_float = checked(float, math.isfinite, "a finite number")
probability = checked(float, lambda v: 0 <= v <= 1, "a number from 0 to 1")
lokr_factor = checked(int, lambda v: v == -1 or v >= 1, "-1 (the most nearly square split) or a whole number >= 1")
decay = checked(float, lambda v: 0 <= v < 1, "a number from 0 up to (not including) 1")
switch = checked(int, lambda v: v in (0, 1), "0 or 1")


def checkpoint_choice(text):
    """--gradient_checkpointing: 1 = recompute every block in backward (True), 0 = none (False), or 'auto'."""
    return text if text == "auto" else bool(switch(text))


def names_list(text):
    """--train_text_encoders: comma-separated names -> a tuple ("" = none)."""
    return tuple(name for name in re.split(r"[,\s]+", text) if name)


def rates(text):
    """--text_encoder_lr: one learning rate, or one per text encoder, comma-separated -> a tuple of them."""
    return tuple(positive_float(part) for part in text.split(","))


def swap_count(text):
    """--blocks_to_swap: 'auto' or a whole number >= 0."""
    return text if text == "auto" else non_negative_int(text)


def worker_count(text):
    """--num_workers: 'auto' or a whole number >= 0."""
    return text if text == "auto" else non_negative_int(text)


def bucket_count(text):
    """--buckets: 'auto', 0 (squares) or an odd number of aspect-ratio buckets (symmetric round the square)."""
    if text != "auto" and not (text.isdigit() and (int(text) == 0 or int(text) % 2 == 1)):
        raise argparse.ArgumentTypeError(f"must be auto, 0 or an odd number, got {text}")
    return text


# ----------------------------------------------------------------------------------------------------------------
# Argument groups several stages share: the training recipe's values are the stage's (its set_defaults)


def add_optimizer_args(parser):
    """The batch, AdamW's rate, decay and clipping, the EMA and the seed."""
    a = parser.recipe.add_argument
    a("--batch_size", type=positive_int, stage_sets=True, help="samples (DPO: pairs) per process")
    a("--accumulation_steps", type=positive_int, stage_sets=True, help="micro-batches a step")
    a("--learning_rate", type=positive_float, stage_sets=True)
    a("--weight_decay", type=non_negative_float, stage_sets=True)
    a("--grad_clip", type=positive_float, stage_sets=True, help="max gradient norm (per network)")
    a("--ema_decay", type=decay, stage_sets=True, help="EMA of what trains, exported and sampled; 0 = none")
    a("--seed", type=non_negative_int, stage_sets=True)


def add_weights_memory_args(parser):
    """A full fine-tune's memory levers: the trained weights held in bf16, and the step fused into backward."""
    a = parser.recipe.add_argument
    a("--trained_dtype", default="fp32", choices=["fp32", "bf16"], help="what the trained weights and their "
      "gradients are held in; bf16 = 2 bytes a parameter each instead of 4 (and AdamW's moments in bf16 with "
      "--optimizer adamw), computing under bf16 autocast")
    a("--stochastic_rounding", type=switch, default=1, help="with --trained_dtype bf16: round each updated weight "
      "up or down at random in proportion (torchao), so updates smaller than bf16's gap still count on average; 0 = "
      "to the nearest (such updates are lost)")
    a("--step_in_backward", type=switch, default=0, help="1 = step each parameter, and free its gradient, as soon "
      "as backward has it: the gradients never all exist at once. One process, --accumulation_steps 1; --grad_clip "
      "then clips each parameter's gradient alone")


def add_block_swap_args(parser):
    """Block swap (model/block_swap.py): the first blocks' weights held in host memory and streamed to the GPU
    around each use. Free to change on resume: the run computes the same bit for bit."""
    parser.free.add_argument("--blocks_to_swap", type=swap_count, default=0, help="hold the weights of this many "
                             "of the transformer's first blocks in host memory (pinned), each copied to the GPU one "
                             "block ahead of its use and recomputed in backward: a small card trains a large model; "
                             "auto = the fewest for the memory estimate to fit this GPU (none on a CPU); 0 = none")


def add_adapter_kind_args(parser):
    """Which adapter (model/model_lora.py, model/lokr.py), for the stages that train adapters."""
    a = parser.recipe.add_argument
    a("--adapter", default="lora", choices=list(ADAPTER_KINDS), help="lora; dora = LoRA with a trained magnitude per "
      "input column (the weight renormalised); lokr = a Kronecker product of two small factors (LyCORIS's), the "
      "second low-rank where --lora_rank is below half its side")
    a("--lokr_factor", type=lokr_factor, default=-1, help="with --adapter lokr: split each dimension with this factor "
      "where it divides it; -1 = the most nearly square split")


def add_adapter_args(parser):
    """The LoRA stage's adapters (model/model_lora.py, model/lokr.py): their kind, rank, alpha, dropout, targets."""
    a = parser.recipe.add_argument
    add_adapter_kind_args(parser)
    a("--lora_rank", type=positive_int, default=8)
    a("--lora_alpha", type=positive_float, default=None, help="the update is scaled by alpha/rank; default: rank "
      "(scale 1)")
    a("--lora_dropout", type=probability, default=0.0)
    a("--lora_targets", default="attention", help=f"comma-separated groups ({', '.join(TARGET_GROUPS)}) or module "
      "name suffixes (e.g. to_q,to_v)")
    a("--train_text_encoders", type=names_list, default=(), help="LoRA (--lora_rank, --lora_alpha) on these text "
      "encoders' attention and MLP too, comma-separated: clip_l,clip_g (and t5, kohya's opt-in) with SD3 "
      "components, text with the built-in one; each then encodes at every step (the cache keeps its token ids), "
      "the others stay cached")
    a("--text_encoder_lr", type=rates, default=None, help="the text encoders' learning rate: one, or one per "
      "encoder in --train_text_encoders' order (kohya's --text_encoder_lr); default: --learning_rate")
    a("--text_encoder_steps", type=non_negative_int, default=0, help="the text encoders train for this many steps, "
      "then stay as they are (kohya's --stop_text_encoder_training); 0 = the whole run")


def add_graph_args(parser):
    """--cuda_graph (model/step_graphs.py): the whole step captured once per shape and replayed. Free to
    change on resume: a graphed step computes what an eager one does."""
    parser.free.add_argument("--cuda_graph", default="auto", choices=["auto", "0", "1"], help="1 = capture the "
                             "whole step (forward, backward, clipping, the optimizer) as a CUDA graph per shape of "
                             "batch and replay it: the host no longer launches each operation (one GPU process, no "
                             "block swap); auto = off until a GPU run has checked graphed steps against eager ones")


def add_routing_args(parser):
    """Token routing (TREAD, model/token_routing.py): a random share of the image tokens skips a run of middle
    blocks in training forwards; sampling and the saved weights never route."""
    a = parser.recipe.add_argument
    a("--route_ratio", type=decay, default=0.0, help="the fraction of each sample's image tokens that skip blocks "
      "--route_first..--route_last while training (0 = off; 0.5 is TREAD's); sampling never routes")
    a("--route_first", type=int, default=2, help="the first block the routed tokens skip")
    a("--route_last", type=int, default=-2, help="the last block they skip (negative counts from the end: -2 is the "
      "block before the last)")


def add_schedule_args(parser):
    """Warmup, the cosine decay, and how long: --epochs, or --max_steps."""
    parser.recipe.add_argument("--warmup_steps", type=non_negative_int, stage_sets=True)
    parser.recipe.add_argument("--min_lr_ratio", type=probability, stage_sets=True, help="after warmup the rate "
                               "decays along a cosine to this fraction of it (1 = constant)")
    parser.length.add_argument("--epochs", type=positive_int, stage_sets=True)
    parser.length.add_argument("--max_steps", type=non_negative_int, stage_sets=True, help="optimizer steps; 0 = run "
                               "--epochs")


def add_flow_args(parser, loss=True):
    """The flow loss's recipe (model/rectified_flow.FlowRecipe): how sigmas are drawn and, with `loss`, the loss,
    its weighting and the caption dropout."""
    a = parser.recipe.add_argument
    a("--sigma_scheme", choices=["logit_normal", "uniform", "mode"], stage_sets=True)
    a("--logit_mean", type=finite_float, stage_sets=True)
    a("--logit_std", type=positive_float, stage_sets=True)
    a("--train_shift", type=positive_float, stage_sets=True, help="shift applied to training sigmas")
    if loss:
        a("--loss", choices=list(LOSSES), stage_sets=True, help="model/rectified_flow.py's LOSSES")
        a("--weighting", choices=list(WEIGHTINGS), stage_sets=True, help="model/rectified_flow.py's WEIGHTINGS")
        a("--caption_dropout", type=probability, stage_sets=True, help="probability of training a sample "
          "unconditionally")


def add_sampling_args(parser):
    """How the sample grids draw (trainer/mechanics/previews.py)."""
    a = parser.free.add_argument
    a("--sample_steps", type=positive_int, default=20, help="Euler steps of the sample grids")
    a("--sample_cfg", type=non_negative_float, default=2.0, help="classifier-free guidance scale")
    a("--sample_shift", type=positive_float, default=3.0)


def add_export_args(parser):
    """What a save writes besides our weights (model/weights.py WeightsExport)."""
    a = parser.free.add_argument
    a("--export_pipeline", action="store_true", help="also write out/<run>/ as a full diffusers pipeline folder "
      "(needs --base and v-prediction); out/<run>/transformer/ is always written for v-prediction")
    a("--export_single_file", action=argparse.BooleanOptionalAction, default=False, help="also write "
      "out/<run>_single_file.safetensors: the original SD3 layout in bf16, for ComfyUI's Load Diffusion Model, "
      "Forge and diffusers' from_single_file (needs v-prediction); --no-export_single_file: not")


# ----------------------------------------------------------------------------------------------------------------
# Plumbing every stage shares


def add_plumbing_args(parser, data="builtin"):
    """Components, data, cache, paths, resume, intervals, logging and (add_hardware_args) the machine: the same for
    every stage. `data`: the default of --data; None for a stage that declares what it trains on itself (preference
    pairs)."""
    if data is not None:
        parser.identity.add_argument("--data", default=data, help="'builtin' shapes, a folder of images + .txt "
                                     "captions, or a .jsonl manifest")
    a = parser.recipe.add_argument
    a("--base", default=None, help="a local diffusers SD3 / SD3.5 folder: its VAE and text encoders (T5 optional) "
      "replace the built-in components; `--from_weight base` starts from its transformer")
    a("--frozen_dtype", default="auto", choices=list(FROZEN_DTYPES), help="what the networks that do not train (a "
      "LoRA base, a teacher, a reference, the VAE and text encoders) are held in; auto = bf16 with --base or on a "
      "GPU, else fp32; int8 = weight-only int8 (torchao) for a LoRA base, to fit SD3.5-Large on a 16 GB card. A "
      "transformer held in bf16 or int8 computes under bf16 autocast")
    a("--t5_max_length", type=positive_int, default=77, help="T5 tokens of the text (SD3 components); diffusers' "
      "pipeline default is 256: pass max_sequence_length to match")
    a("--buckets", type=bucket_count, default="auto", help="aspect-ratio buckets for your images: an odd count, "
      "0 = centre-cropped squares, auto = 5 on SD3 components (--base), else 0")
    a = parser.free.add_argument
    a("--cache", default="auto", choices=["auto", "0", "1"], help="encode latents and text once into --cache_dir "
      "and train from that; auto = on with --base (the SD3 encoders are most of a step)")
    a("--cache_dir", default=DEFAULT_CACHE_DIR)
    a("--cache_only", action="store_true", help="build the cache, then stop")
    a("--out_dir", default=DEFAULT_OUT_DIR)
    a("--save_dir", default=DEFAULT_SAVE_DIR)
    a("--from_resume", default="0", help="1 = continue from the resume checkpoint in --save_dir if there is one; "
      "or the path of a resume checkpoint (its .json)")
    a("--force_resume", type=switch, default=0, help="1 = resume even though recipe settings (learning rate, batch "
      "size...) changed; what the run is (preset, resolution, data, prediction) can never change")
    a("--save_interval", type=positive_int, stage_sets=True, help="steps between saves of weights and resume "
      "checkpoint")
    a("--save_dtype", choices=list(SAVE_DTYPES), stage_sets=True, help="dtype of the exported weights")
    a("--sample_interval", type=non_negative_int, stage_sets=True, help="steps between sample grids; 0 = only at the "
      "end")
    a("--sample_prompts", default=None, help="file of prompts for the sample grids, one a line; default: fixed "
      "prompts for the built-in data, else 8 captions of the dataset")
    a("--log_interval", type=positive_int, default=1, help="steps between the reads of the loss and the other "
      "values to the host (their rows in the metrics file, the progress bar, a stop agreed on by the processes): "
      "between two, a GPU runs ahead with nothing to wait for; every save, validation and the end are one too")
    a("--log_sample_ids", type=switch, default=0, help="1 = record in the metrics file which dataset indices each "
      "step trained on (to audit the data order across resumes)")
    add_hardware_args(parser)
    a("--use_wandb", action="store_true", help="log to wandb (offline without WANDB_API_KEY)")
    a("--wandb_project", default="MiniSD3")
    return parser


def add_hardware_args(parser):
    """How the run uses the machine: data loader processes, autocast, recomputation, the EMA's device, compiling,
    sharding over the processes and how long they wait for one another."""
    a = parser.free.add_argument
    a("--num_workers", type=worker_count, default="auto", help="data loader processes; auto = 0 on a CPU (every "
      "core trains), 4 for each GPU within the cores a process has")
    a("--dtype", default="auto", choices=["auto", "fast", "fp32", "bf16"], help="autocast; auto = bf16 on a GPU, "
      "fp32 on a CPU; fast = bf16 on a GPU, and on a CPU where a quick check at start-up finds it faster (native "
      "bf16: AVX512-BF16, AMX) in the stages that allow it (pretrain, SFT, LoRA), else fp32")
    a("--gradient_checkpointing", type=checkpoint_choice, default=False, help="1 = recompute each block in backward "
      "(less memory, a second forward of each); auto = the fewest blocks for the memory estimate to fit the device "
      "(on a 24 GB card, none for an SD3.5-Medium LoRA at batch 1: twice as fast)")
    a("--encode_batch_size", type=positive_int, default=4, help="images (and captions) the VAE and text encoders "
      "take at once while the cache is built, before the transformer is loaded")
    a("--ema_device", default="auto", choices=["auto", "cpu"], help="cpu = keep the EMA of the weights in host "
      "memory instead of the GPU's (4 bytes a parameter off the GPU; its update copies the weights over)")
    a("--compile", type=switch, default=0, help="1 = torch.compile each transformer block (faster steps on a GPU, "
      "after a first step that compiles)")
    a("--fsdp", type=switch, default=0, help="1 = shard weights, gradients and AdamW state over the processes "
      "(FSDP2) instead of a whole copy on each (DDP): for models that do not fit one GPU with their optimizer")
    a("--dist_timeout", type=positive_float, default=60, help="minutes a process waits for the others in a "
      "collective before the run fails: under DDP rank 0 alone writes and verifies each save (tens of GB at "
      "SD3.5-Large size) while the others wait")
    a("--fsdp_shard_size", type=non_negative_int, default=0, help="with --fsdp: shard within groups of this many "
      "processes (e.g. one node's GPUs) and replicate across groups (hybrid sharding); 0 = shard over all")
    return parser


def add_data_args(parser):
    """What a stage does with your images (--data a folder or .jsonl; dataset/samples.py), as kohya's sd-scripts
    and OneTrainer do it, and the images held out for validation."""
    a = parser.recipe.add_argument
    a("--num_samples", type=positive_int, stage_sets=True, help="size of the built-in dataset")
    a("--caption_prefix", default="", help="put before every caption, e.g. a trigger word: 'sks photo, '")
    a("--caption_suffix", default="", help="put after every caption")
    a("--caption_lines", default="each", choices=["each", "join"], help="a .txt of several lines: each line a "
      "caption (an epoch draws one; each is cached), or the lines joined into one")
    a("--random_flip", type=probability, default=0.0, help="the probability of mirroring an image left to right "
      "(both are cached); leave 0 for text, logos, asymmetric subjects")
    a("--shuffle_tags", type=switch, default=0, help="1 = shuffle the comma-separated tags of each caption per "
      "sample and epoch, after the first --keep_tags (needs the text encoders each step: --cache 0)")
    a("--keep_tags", type=non_negative_int, default=0, help="with --shuffle_tags: how many leading tags stay in "
      "place (a trigger word from --caption_prefix counts as one)")
    parser.identity.add_argument("--val_fraction", type=probability, default=0.0, help="hold out this fraction of "
                                 "--data for validation, never trained on (e.g. 0.1)")


def add_validation_args(parser):
    """The validation loss while training: eval/eval_loss.py's fixed sigmas and noise on held-out images."""
    a = parser.free.add_argument
    a("--val_data", default=None, help="validation images: a folder, a .jsonl, or 'builtin' (the built-in held-out "
      "split); or hold out part of --data with --val_fraction")
    a("--val_interval", type=positive_int, default=100, help="steps between validation losses (and at the end)")
    a("--val_samples", type=positive_int, default=64, help="at most this many validation images")
