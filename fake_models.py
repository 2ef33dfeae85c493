"""The models benchmark.py can serve, built in code with random weights (nothing downloaded).

    python fake_models.py resnet18                  # -> models/resnet18.pt (TorchScript)
    python fake_models.py encoder --format both     # -> models/encoder.pt and models/encoder.pt2

    name       architecture (module)                               input per item     default size
    resnet50   bottleneck ResNet-50, 25.6 M params (fake_resnet50)  image 3 x S x S    S = 224
    resnet18   basic-block ResNet-18, 11.7 M params (fake_resnet50) image 3 x S x S    S = 112
    tiny       one-block ResNet of width 8 (fake_resnet50)          image 3 x S x S    S = 224
    encoder    transformer encoder, 4 x d256, 64 tokens (fake_encoder)  float 64 x 256  --

This module imports torch only to build or write a model: benchmark.py (and each of its worker
processes, which spawn re-imports) asks it for input shapes without paying for torch.
"""
from __future__ import annotations

import argparse
import importlib
import os
import time
import warnings
from typing import NamedTuple, Optional, Tuple


class FakeModel(NamedTuple):
    builder: str                    # "module:function", called with a seed
    image_size: int                 # default side of a square image input; 0: not an image model
    shape: Tuple[int, ...] = ()     # the fixed item shape of a non-image model


MODELS = {
    "resnet50": FakeModel("fake_resnet50:build_resnet50", 224),
    "resnet18": FakeModel("fake_resnet50:build_resnet18", 112),
    "tiny": FakeModel("fake_resnet50:build_tiny", 224),
    "encoder": FakeModel("fake_encoder:build_encoder", 0, (64, 256)),  # fake_encoder.SEQ, D_MODEL
}


def _spec(name: str) -> FakeModel:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"model: expected one of {', '.join(MODELS)}, got {name!r}") from None


def default_image_size(name: str) -> int:
    """The image side ``name`` is measured at unless told otherwise (0 for a non-image model)."""
    return _spec(name).image_size


def item_shape(name: str, image_size: Optional[int] = None) -> Tuple[int, ...]:
    """The shape of one request's input, without the batch dimension."""
    m = _spec(name)
    if not m.image_size:
        return m.shape
    s = image_size or m.image_size
    return (3, s, s)


def build(name: str, seed: int = 0):
    """The model as an eval-mode ``nn.Module``, random weights from ``seed``."""
    module, func = _spec(name).builder.split(":")
    return getattr(importlib.import_module(module), func)(seed)


def export(name: str, out_dir: str = "models", fmt: str = "torchscript", file_name: Optional[str] = None) -> list:
    """Write model ``name`` as TorchScript (``.pt``, traced) and/or torch.export (``.pt2``) files
    with a dynamic batch dimension; returns the paths written."""
    import torch
    return write(build(name), torch.randn(2, *item_shape(name)), out_dir, fmt, file_name or name)


def write(model, example, out_dir: str, fmt: str, file_name: str) -> list:
    """Trace ``model`` on ``example`` into ``out_dir/file_name.pt`` (TorchScript) and/or export it
    into ``.pt2`` (torch.export), with a dynamic batch dimension; returns the paths written."""
    import torch
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    with torch.no_grad(), warnings.catch_warnings():
        # TorchScript is deprecated in recent torch but still what many deployments load.
        warnings.simplefilter("ignore", DeprecationWarning)
        if fmt in ("both", "torchscript"):
            path = os.path.join(out_dir, f"{file_name}.pt")
            torch.jit.save(torch.jit.trace(model, example), path)
            paths.append(path)
        if fmt in ("both", "export"):
            path = os.path.join(out_dir, f"{file_name}.pt2")
            batch = torch.export.Dim("batch", min=1, max=4096)
            ep = torch.export.export(model, (example,), dynamic_shapes={"x": {0: batch}})
            torch.export.save(ep, path)
            paths.append(path)
    return paths


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", choices=tuple(MODELS))
    ap.add_argument("--out", default="models", help="output folder (default: models)")
    ap.add_argument("--format", choices=("both", "torchscript", "export"), default="torchscript")
    args = ap.parse_args()
    t = time.perf_counter()
    for path in export(args.model, args.out, args.format):
        print(f"wrote {path} ({os.path.getsize(path) / 2**20:.1f} MiB)")
    print(f"done in {time.perf_counter() - t:.1f} s")


if __name__ == "__main__":
    main()
