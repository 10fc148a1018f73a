import logging
import os

# torchao, which transformers and diffusers import whenever it is installed, logs a line for each kernel it has
# for GPUs this machine lacks, torch a deprecation note for each of torchao's enums, and diffusers a note that it
# could not import torchao's tensor classes: none of them is ours to show.
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
