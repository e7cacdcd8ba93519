#!/usr/bin/env python3
"""Write the shipped H200 profiles that are derived, not recorded: each CPU profile's
forward, backward and per-parameter ready times, as fractions of its forward + backward,
scaled to the forward + backward and step times one NVIDIA H200 measured for the same model
(docs/benchmarks.md, "On GPUs": the plain rows of tools/gpu-check.sh, 2026-11-27, batch 64 of
224x224). Each file says so in ``derived_from`` and ``note``; a profile recorded on an H200
(`bpsctl profile MODEL --device cuda`) should replace it.

    python tools/derive-profiles.py      # rewrites bpsctl/bench/profiles/h200-*.json
"""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bpsctl.bench import profile  # noqa: E402

#: model: (forward + backward seconds, step seconds) of the plain rows on one H200
H200 = {"resnet50": (32.0e-3, 32.1e-3), "vgg16": (46.9e-3, 47.4e-3)}
MEASURED = ("measured with no communication on one NVIDIA H200 (torch 2.11, CUDA 13) by "
            "tools/gpu-check.sh on 2026-11-27 (docs/benchmarks.md, On GPUs)")


def main() -> None:
    folder = REPO / "bpsctl" / "bench" / "profiles"
    for model, (forward_backward_s, step_s) in H200.items():
        base_name = f"cpu-{model}"
        base = profile.read(folder / f"{base_name}.json")
        derived = profile.derive(base, base_name, "NVIDIA H200", forward_backward_s, step_s,
                                 batch_size=64, image_size=224, measured=MEASURED)
        derived.write(folder / f"h200-{model}.json")
        print(f"wrote h200-{model}.json from {base_name}.json")


if __name__ == "__main__":
    main()
