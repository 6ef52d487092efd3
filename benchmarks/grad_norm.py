"""Accuracy and cost of the global gradient norm over one long flat fp32 buffer.

Compares, against the fp64 norm of the same values (gradient-like: normal times a heavy
tail), the norm zerotrain takes (``zerotrain.utils.norms``: fp32 norms of 1024-element rows,
their squares added in fp64), torch's single fp32 reduction (``torch._foreach_norm``, what
the flat buffers used before, and ``torch.linalg.vector_norm``), and the whole buffer cast
to fp64. Reports the relative error, the error in fp32 ulps of the exact value, and the
median time of ``--repeats`` calls.

    OMP_NUM_THREADS=1 python benchmarks/grad_norm.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from zerotrain.utils.norms import squared_norm

METHODS: dict[str, Callable[[torch.Tensor], float]] = {
    "zerotrain (rows + fp64)": lambda x: squared_norm(x).sqrt().item(),
    "torch._foreach_norm (fp32)": lambda x: torch._foreach_norm([x])[0].item(),
    "vector_norm(dtype=fp64)": lambda x: torch.linalg.vector_norm(x, dtype=torch.float64).item(),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1e5,1e6,3.3e6,1e7,1e8")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| elements | method | relative error | fp32 ulps | ms (median) |")
    print("|---|---|---|---|---|")
    for numel in (int(float(s)) for s in args.sizes.split(",")):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(numel, generator=gen) * torch.rand(numel, generator=gen).pow_(4)
        exact = x.double().norm().item()
        rounded = torch.tensor(exact, dtype=torch.float32)
        ulp = (torch.nextafter(rounded, torch.tensor(float("inf"))) - rounded).item()
        for name, method in METHODS.items():
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                value = method(x)
                times.append(time.perf_counter() - start)
            err = abs(value - exact) / exact
            ulps = abs(torch.tensor(value, dtype=torch.float32).item() - rounded.item()) / ulp
            ms = statistics.median(times) * 1e3
            print(f"| {numel:,} | {name} | {err:.1e} | {ulps:.1f} | {ms:.2f} |")
        del x


if __name__ == "__main__":
    main()
