"""A stand-in for the two torchvision pieces DeepSpeed's cifar example uses, for tests only.

torchvision is not installed here (and the example would download CIFAR-10), so the tests put
this folder first on PYTHONPATH: ``import torchvision`` in the unchanged example then finds
``datasets.CIFAR10`` (synthetic images of CIFAR's shapes and dtype, no download) and
``transforms.Compose/ToTensor/Normalize`` (the same arithmetic as torchvision's).
"""

from . import datasets, transforms  # noqa: F401
