"""Medusa heads: extra prediction heads on the target's final hidden state (Cai et al., 2024).

Head i maps the normalised hidden state h of the last committed position to
h + SiLU(W_i h + b_i) and reads it out with the target's own LM head, guessing the token i + 1
positions ahead. One step's heads give the next step's whole draft, with no extra forward pass.

Checkpoint format (a folder): ``config.json`` = {"format": "specserve-medusa/1", "num_heads",
"hidden_size", "target", "training": {...}} and ``heads.safetensors`` with ``heads.{i}.weight``
[E, E] and ``heads.{i}.bias`` [E] for i in 0..num_heads-1.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..config import ConfigError
from ..model.model import CausalLM, upload
from ..sampling import RequestSampler
from .base import Drafter, DraftResources, Proposal, draw
from .registry import register

FORMAT = "specserve-medusa/1"
SHIPPED = Path(__file__).resolve().parent.parent / "medusa_heads"


class MedusaHeads(nn.Module):
    def __init__(self, num_heads: int, hidden_size: int) -> None:
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_heads))
        for head in self.heads:  # start as the identity: every head first guesses what the LM head guesses
            nn.init.zeros_(head.weight)
            nn.init.zeros_(head.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., E] (after the final norm) -> per-head features [..., H, E]."""
        return torch.stack([hidden + nn.functional.silu(head(hidden)) for head in self.heads], dim=-2)

    def save(self, folder: Path, target: str, training: dict) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {name: value.detach().to(torch.float16).contiguous() for name, value in self.state_dict().items()}
        save_file(tensors, folder / "heads.safetensors")
        config = {
            "format": FORMAT,
            "num_heads": len(self.heads),
            "hidden_size": self.heads[0].in_features,
            "target": target,
            "training": training,
        }
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    @classmethod
    def load(cls, folder: Path) -> MedusaHeads:
        config = check_checkpoint(folder)
        heads = cls(config["num_heads"], config["hidden_size"])
        heads.load_state_dict({k: v.float() for k, v in load_file(folder / "heads.safetensors").items()})
        return heads.eval().requires_grad_(False)


def check_checkpoint(folder: Path) -> dict:
    """The checkpoint's config, once it is known to be a Medusa head checkpoint with its weights."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"no Medusa head checkpoint at {folder} (expected config.json and heads.safetensors)")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{config_path}: not JSON ({exc})") from None
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        raise ConfigError(f"{config_path}: format must be {FORMAT!r}")
    if not (folder / "heads.safetensors").is_file():
        raise ConfigError(f"{folder}: heads.safetensors is missing")
    return config


class MedusaDrafter(Drafter):
    name = "medusa"
    per_sequence = ("_hidden",)

    def __init__(self, target: CausalLM, heads: MedusaHeads) -> None:
        if heads.heads[0].in_features != target.config.hidden_size:
            raise ConfigError("the Medusa heads were trained for a model of another hidden size")
        self.target = target
        self.heads = heads.to(device=target.device, dtype=target.dtype)
        self._hidden: torch.Tensor | None = None  # [E] normalised hidden state of the last committed position

    def begin(self, prompt_ids: list[int], tenant: str = "") -> None:
        self._hidden = None  # the first step runs the target alone and yields the first hidden state

    @torch.inference_mode()
    def propose(self, token_ids: list[int], num_draft_tokens: int, sampler: RequestSampler) -> Proposal:
        if self._hidden is None:
            return Proposal.empty(self.target.device)
        count = min(num_draft_tokens, len(self.heads.heads))
        features = self.heads(self._hidden)[:count]  # [k, E]
        logits = self.target.logits(features)  # [k, V]
        drafted: list[int] = []
        rows: list[torch.Tensor] = []
        for i in range(count):
            appended = upload(drafted, logits.device)
            q = sampler.probs(logits[i : i + 1], appended)  # [1, V]
            drafted.append(int(draw(q[0], sampler, i)))
            rows.append(q[0])
        return Proposal(upload(drafted, logits.device), torch.stack(rows))

    def accept(self, num_committed: int) -> None:
        """Keep the target's hidden state at the last committed position, from the verify pass."""
        self._hidden = self.target.hidden_at(num_committed - 1)


def shipped_heads(model_name: str) -> Path:
    return SHIPPED / model_name.rstrip("/").split("/")[-1]


@register("medusa", MedusaDrafter)
def _build(resources: DraftResources) -> MedusaDrafter:
    folder = resources.config.medusa_heads
    path = Path(folder) if folder else shipped_heads(resources.config.target or "SmolLM2-135M-Instruct")
    return MedusaDrafter(resources.target, MedusaHeads.load(path))
