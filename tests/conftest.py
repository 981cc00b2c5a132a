"""Test-wide settings: DeepSpeed on the CPU accelerator, quiet logs."""

import os

# DeepSpeed picks its accelerator when first imported.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
