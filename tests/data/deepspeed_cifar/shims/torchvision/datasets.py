"""``CIFAR10``: 32x32 RGB uint8 images and labels 0-9, generated, never downloaded.

Sizes: CIFAR_SHIM_TRAIN_SIZE (default 160) and CIFAR_SHIM_TEST_SIZE (default 40) samples. Each
class has its own fixed pattern under the noise, so the network has something to learn; the
test set cycles through the classes (the example's per-class accuracy divides by each count).
"""

from __future__ import annotations

import os

import torch


class CIFAR10(torch.utils.data.Dataset):
    classes = ["plane", "car", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]

    def __init__(self, root, train=True, transform=None, target_transform=None, download=False):
        size = int(os.environ.get("CIFAR_SHIM_TRAIN_SIZE" if train else "CIFAR_SHIM_TEST_SIZE", 160 if train else 40))
        generator = torch.Generator().manual_seed(0 if train else 1)  # never the global RNG
        patterns = torch.randint(0, 256, (10, 32, 32, 3), generator=torch.Generator().manual_seed(7))
        if train:
            self.targets = torch.randint(0, 10, (size,), generator=generator).tolist()
        else:
            self.targets = [i % 10 for i in range(size)]
        noise = torch.randint(0, 256, (size, 32, 32, 3), generator=generator)
        self.data = ((noise + patterns[self.targets]) // 2).to(torch.uint8)  # HWC, as torchvision keeps it
        self.transform, self.target_transform = transform, target_transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index):
        image, target = self.data[index], self.targets[index]
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target
