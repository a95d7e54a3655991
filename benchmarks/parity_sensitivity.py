"""How far one BF16 ulp travels through a random-weight Beam: the yardstick for `bench model`'s
parity column.

    python benchmarks/parity_sensitivity.py --layers 52 --hidden 256 --prompts 10

For each prompt, the last token's logits of a full forward are compared with those of the same
forward in which one element of that token's embedding is moved by one BF16 ulp. With random
weights the routing of every MoE layer is a coin toss between near-equal experts, so a change that
small can pick another expert and change the top-1 token: a kernel set that is not bitwise the
reference differs in top-1 for the same reason, without being wrong. (The judge checks each
kernel's rounding; this says what to expect of the whole model.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def one_ulp_effect(layers: int, hidden: int, prompts: int, tokens: int = 24,
                   seed: int = 0) -> dict:
    import torch

    from model.config import PRESETS
    from model.tp_ranks import random_rank_model

    cfg = PRESETS["tiny"].replace(num_hidden_layers=layers, hidden_size=hidden)
    model = random_rank_model(cfg, 1, 0, "cpu", seed=seed)
    embed = model.embed
    flips, diffs, scale = 0, [], 0.0
    for p in range(prompts):
        g = torch.Generator().manual_seed(seed * 100003 + p)
        ids = torch.randint(8, cfg.vocab_size, (1, tokens), generator=g)
        j = int(torch.randint(0, hidden, (1,), generator=g))

        def nudged(x, j=j):
            h = embed(x).clone()
            up = torch.full((1,), float("inf"), dtype=h.dtype)
            h[-1, j] = torch.nextafter(h[-1, j:j + 1], up)[0]
            return h

        with torch.no_grad():
            a = model(ids)[0, -1]
            model.embed = nudged
            try:
                b = model(ids)[0, -1]
            finally:
                model.embed = embed
        flips += int(a.argmax() != b.argmax())
        diffs.append(float((a - b).abs().max()))
        scale = max(scale, float(a.abs().max()))
    return {"layers": layers, "hidden": hidden, "prompts": prompts, "top1_flips": flips,
            "max_diff_median": statistics.median(diffs), "max_diff_max": max(diffs),
            "logit_scale": scale}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=52)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--prompts", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    r = one_ulp_effect(args.layers, args.hidden, args.prompts, seed=args.seed)
    print(f"{r['layers']} layers, hidden {r['hidden']}: one BF16 ulp in one embedding element "
          f"changed the top-1 token in {r['top1_flips']} of {r['prompts']} prompts; largest "
          f"logit difference: median {r['max_diff_median']:.3g}, max {r['max_diff_max']:.3g} "
          f"(logits up to {r['logit_scale']:.3g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
