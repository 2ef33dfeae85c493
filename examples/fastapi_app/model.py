"""The example's model: a small MLP with fixed weights, so a test can check every answer by
running the same model directly. Swap in your own factory (or a TorchScript path) in serve.toml."""
import torch
from torch import nn

IN_FEATURES, OUT_FEATURES = 16, 4


class TinyMLP(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(IN_FEATURES, 64), nn.ReLU(), nn.Linear(64, OUT_FEATURES))

    def forward(self, x):
        if bool((x == -999).any()):  # lets the example show how a model error is reported
            raise ValueError("the model refuses -999")
        return self.net(x)


def build() -> nn.Module:
    return TinyMLP().eval()
