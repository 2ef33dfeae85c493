"""Write a ResNet-50 with random weights as TorchScript and torch.export files (no torchvision).

    python fake_resnet50.py                 # -> models/resnet50.pt and models/resnet50.pt2
    python fake_resnet50.py --out DIR --format torchscript

The architecture is the standard bottleneck ResNet-50 (3-4-6-3 blocks, 25.6 M parameters); the
batch dimension of both files is dynamic. ``build_resnet50()``, ``build_resnet18()`` (basic
blocks, 2-2-2-2, 11.7 M parameters) and ``build_tiny()`` are also used by benchmark.py (through
fake_models.py, which writes any of them) and the tests as in-process factories.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1):
        super().__init__()
        width = planes
        self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or inplanes != planes * self.expansion:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, planes * self.expansion, 1, stride=stride, bias=False),
                nn.BatchNorm2d(planes * self.expansion))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions and the identity (ResNet-18 and -34)."""
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(planes))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, layers=(3, 4, 6, 3), num_classes: int = 1000, base: int = 64, block=Bottleneck):
        super().__init__()
        self.inplanes = base
        self.conv1 = nn.Conv2d(3, base, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(base)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.layer1 = self._make(block, base, layers[0], 1)
        self.layer2 = self._make(block, base * 2, layers[1], 2)
        self.layer3 = self._make(block, base * 4, layers[2], 2)
        self.layer4 = self._make(block, base * 8, layers[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(base * 8 * block.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def _make(self, block, planes: int, blocks: int, stride: int) -> nn.Sequential:
        layers = [block(self.inplanes, planes, stride)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def build_resnet50(seed: int = 0) -> nn.Module:
    """ResNet-50, random weights from ``seed`` (so every model process builds the same model)."""
    torch.manual_seed(seed)
    return ResNet().eval()


def build_resnet18(seed: int = 0) -> nn.Module:
    """ResNet-18 (basic blocks, 2-2-2-2), random weights from ``seed``."""
    torch.manual_seed(seed)
    return ResNet(layers=(2, 2, 2, 2), block=BasicBlock).eval()


def build_tiny(seed: int = 0) -> nn.Module:
    """A one-block ResNet of width 8: same shapes in and out as ResNet-50, fast on a CPU."""
    torch.manual_seed(seed)
    return ResNet(layers=(1, 1, 1, 1), base=8).eval()


def export(out_dir: str, fmt: str = "both", tiny: bool = False, name: str = "resnet50") -> list:
    """Write the model; returns the paths written."""
    from fake_models import write   # beside this file
    model = build_tiny() if tiny else build_resnet50()
    return write(model, torch.randn(2, 3, 224, 224), out_dir, fmt, name)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="models", help="output folder (default: models)")
    ap.add_argument("--format", choices=("both", "torchscript", "export"), default="both")
    ap.add_argument("--tiny", action="store_true", help="write the small test model instead")
    args = ap.parse_args()
    t = time.perf_counter()
    for path in export(args.out, args.format, args.tiny, "tiny_resnet" if args.tiny else "resnet50"):
        print(f"wrote {path} ({os.path.getsize(path) / 2**20:.1f} MiB)")
    print(f"done in {time.perf_counter() - t:.1f} s")


if __name__ == "__main__":
    main()
