"""A stand-in for Hugging Face ``datasets`` (not installed here): DeepSpeed-Chat's data code calls
``load_from_disk(path)`` for a dataset directory that exists; this one reads the ``train.json`` and
``test.json`` lists that tests/data/deepspeed_chat/fixture.py writes there."""

import json
import os


def load_from_disk(path):
    return {split: json.load(open(os.path.join(path, f"{split}.json"))) for split in ("train", "test")}


def load_dataset(*args, **kwargs):
    raise RuntimeError("this datasets stand-in reads local directories only (load_from_disk)")
