"""What the first forward pass of each new batch size costs (eager, the README's default path).

    python experiments/first_batch_cost.py --model_path models/resnet50.pt [--max 32]

For n = 1..max: the time of the first forward of a batch of n rows, then of the second (synced).
A large first/second gap is per-shape set-up inside the libraries (cuDNN execution plans), paid
once per batch size and item shape: it shows up in the tail of a short benchmark where batch
sizes vary."""
import argparse
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model_path", required=True)
    ap.add_argument("--max", type=int, default=32)
    a = ap.parse_args()
    model = torch.jit.load(a.model_path, map_location="cuda").eval()
    with torch.inference_mode():
        x = torch.randn(a.max, 3, 224, 224, device="cuda")
        model(x[:a.max]); torch.cuda.synchronize()
        rows = []
        for n in range(1, a.max + 1):
            t = []
            for _ in range(2):
                t0 = time.perf_counter(); model(x[:n]); torch.cuda.synchronize()
                t.append((time.perf_counter() - t0) * 1e3)
            rows.append((n, *t))
            print(f"batch {n:3d}: first {t[0]:8.2f} ms  second {t[1]:7.2f} ms", flush=True)
        extra = sum(f - s for _, f, s in rows)
        print(f"first-time extra over {a.max} sizes: {extra:.0f} ms")


if __name__ == "__main__":
    main()
