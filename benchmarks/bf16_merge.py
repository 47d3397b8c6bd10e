"""How much of a small knob update a bf16 layer realises: merged W_eff (the fused forward) vs the side branch.

A 256×256 bf16 Linear (weights ~ N(0, 0.02)) wrapped with a full-rank SVD knob; δS = ε·S·z with z ~ N(0, 1)
(a relative update of size ε per singular value). For 4096 bf16 inputs x, the exact change of the output
is Δ = x·ΔWᵀ (fp64, with W's bf16 values). Each forward's realised change y − y_base (y_base: the same
forward at zero knobs) is compared with Δ: `realised` = ⟨y − y_base, Δ⟩ / ‖Δ‖² (1: the update arrives in
full on average), `err` = ‖y − y_exact‖ / ‖Δ‖. Forwards: the fused one (W_eff = W + ΔW rounded to bf16),
the pre-fusion side branch (x·Wᵀ + branch, each rounded to bf16: knobs/reference.py), and for contrast
an fp32 W_eff with an fp32 matmul (not implemented in the adapters: twice the weight memory).

    .venv/bin/python benchmarks/bf16_merge.py

Last line: `RESULT realised_fused_over_branch=<mean ratio over the ε where the branch realises ≥ 1%>`.
"""

from __future__ import annotations

import pathlib
import sys
import tempfile
from collections import OrderedDict

import torch
from torch import nn

from projected_grpo.knobs.adapters import wrap

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))  # the test oracles
from oracles import branch_path


def main() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(256, 256, bias=False)
    with torch.no_grad():
        lin.weight.normal_(0, 0.02)
    lin = lin.to(torch.bfloat16)
    with tempfile.TemporaryDirectory() as cache:
        knobs = wrap(nn.Sequential(OrderedDict(o_proj=lin)), "svd", cache_dir=cache)
    m = knobs.modules["o_proj"]
    S = torch.linalg.svdvals(lin.weight.float())
    x = torch.randn(4096, 256).bfloat16()
    with torch.no_grad():
        y_base = knobs.model(x).double()  # zero knobs: W itself
    ratios = []
    print("     ε | fused realised  err | branch realised  err | fp32 W_eff realised  err")
    for eps in (1e-5, 1e-4, 1e-3, 1e-2, 1e-1):
        m.delta.data = eps * S * torch.randn(S.shape)
        dW = m.delta_weight(m.delta.detach()).double()
        delta = x.double() @ dW.T  # the exact change
        y_exact = x.double() @ (lin.weight.double() + dW).T
        with torch.no_grad():
            fused = knobs.model(x).double()
            with branch_path(knobs):
                branch = knobs.model(x).double()
            fp32 = (x.float() @ (lin.weight.float() + dW.float()).T).double()
        row = f"{eps:6.0e}"
        real = {}
        for name, y in (("fused", fused), ("branch", branch), ("fp32", fp32)):
            real[name] = float(((y - y_base) * delta).sum() / (delta * delta).sum())
            row += f" | {real[name]:8.3f} {float((y - y_exact).norm() / delta.norm()):8.2f}"
        print(row)
        if real["branch"] >= 0.01:
            ratios.append(real["fused"] / real["branch"])
    print(f"RESULT realised_fused_over_branch={sum(ratios) / len(ratios):.3f}")


if __name__ == "__main__":
    main()
