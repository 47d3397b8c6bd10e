"""PPO's critic: a linear value head V_t = w·h_t + b on the policy's last hidden state h_t (after the final
norm).

h_t is the state that predicts completion token t, so V_t estimates the return of the sequence from before
token t on. The head reads h detached: the value loss trains the head alone and never reaches the knobs, so
a knob gradient is the policy's gradient only and the projection arms see exactly what they see under GRPO
(the head is not projected). w and b start at zero (V = 0; no draw from the torch RNG, so adding the head
changes no other random number of a run). Saved in checkpoints beside the knobs (`state` / `load_state`).
Not here: the value loss and GAE (objective/losses.py), the forward that yields h (run/ppo.py).
"""

from __future__ import annotations

import torch
from torch import nn

PREFIX = "value_head."


class ValueHead(nn.Module):
    """w (H,) and b () in fp32; forward(hidden (N, T, H), mask (N, T)) -> values (N, T) fp32, 0 off the
    mask."""

    def __init__(self, hidden_size: int, device: torch.device | str = "cpu"):
        super().__init__()
        if hidden_size < 1:
            raise ValueError(f"ValueHead: hidden_size must be >= 1, got {hidden_size}")
        self.weight = nn.Parameter(torch.zeros(hidden_size, device=device))
        self.bias = nn.Parameter(torch.zeros((), device=device))

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if hidden.dim() != 3 or hidden.shape[-1] != self.weight.shape[0] or hidden.shape[:2] != mask.shape:
            raise ValueError(f"ValueHead: hidden must be (N, T, H={self.weight.shape[0]}) with mask (N, T), "
                             f"got {tuple(hidden.shape)} and {tuple(mask.shape)}")
        values = hidden.detach().float() @ self.weight + self.bias  # (N, T)
        # where, not multiply: a padded position reads exactly 0 whatever its hidden state holds
        return torch.where(mask > 0, values, torch.zeros((), device=values.device))

    def state(self) -> dict[str, torch.Tensor]:
        """Tensors to save (checkpoint extra), name -> tensor."""
        return {PREFIX + "weight": self.weight.detach(), PREFIX + "bias": self.bias.detach()}

    def load_state(self, tensors: dict[str, torch.Tensor], where: str) -> None:
        """Values saved by `state`; a missing or misshapen tensor raises naming `where`."""
        for name, p in (("weight", self.weight), ("bias", self.bias)):
            t = tensors.get(PREFIX + name)
            if t is None or t.shape != p.shape:
                found = None if t is None else tuple(t.shape)
                raise ValueError(f"{where}: no value head tensor {PREFIX + name} of shape {tuple(p.shape)} "
                                 f"(found {found}); was it written by a PPO run?")
            with torch.no_grad():
                p.copy_(t)
