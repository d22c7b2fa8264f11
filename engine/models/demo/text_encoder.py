"""Word tokenizer over the demo grammar's vocabulary and a small transformer text encoder.

Tokens: <pad>=0, <bos>=1, <unk>=2, "," and the grammar's words. A prompt becomes [<bos>, words...]
without the filler words ("a", "the", "on", "at", "in": they carry nothing the grammar needs, and
dropping them keeps the joint sequence short); the empty prompt is just [<bos>] (the unconditional input used for CFG). The encoder output
[T, text_dim] per prompt is what the ERNIE-Image DiT takes as text features.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import List, Sequence

import torch
from torch import nn

PAD, BOS, UNK = "<pad>", "<bos>", "<unk>"
FILLER = frozenset({"a", "an", "the", "on", "at", "in", "of"})
# where a shape goes: one of these per shape ("top right" is two, which the grammar never says)
POSITIONS = ("left", "right", "top", "bottom", "center")


class WordTokenizer:
    def __init__(self, vocab: Sequence[str]):
        self.vocab = list(vocab)
        self.index = {w: i for i, w in enumerate(self.vocab)}
        assert self.vocab[:3] == [PAD, BOS, UNK], "vocabulary must start with <pad>, <bos>, <unk>"

    @classmethod
    def from_words(cls, words: Sequence[str]) -> "WordTokenizer":
        return cls([PAD, BOS, UNK, ","] + [w for w in words if w not in (PAD, BOS, UNK, ",") and w not in FILLER])

    @staticmethod
    def split(prompt: str) -> List[str]:
        return [w for w in re.findall(r"[a-z]+|,", prompt.lower()) if w not in FILLER]

    def unknown_words(self, prompt: str) -> List[str]:
        """What the demo model does not know in ``prompt`` (each once, in order): words outside the vocabulary
        (they become <unk>) and positions joined into one ("top right": the grammar gives a shape one position,
        so the model draws one of the two, or neither)."""
        words = self.split(prompt)
        unknown, run = [], []
        for w in words + [","]:  # "," ends the last run of positions
            if w in POSITIONS:
                run.append(w)
                continue
            if len(run) > 1:
                unknown.append(" ".join(run))
            run = []
            if w not in self.index:
                unknown.append(w)
        return list(dict.fromkeys(unknown))

    def unknown_words_warning(self, prompt: str, where: str = "") -> str:
        """A warning naming what the demo model does not know (``where``: e.g. " in --prompt"), or "" when it knows
        it all. Lists the words it knows (docs/demo.md)."""
        unknown = self.unknown_words(prompt)
        if not unknown:
            return ""
        known = [w for w in self.vocab if w not in (PAD, BOS, UNK, ",")]
        return (f"the demo model does not know {', '.join(repr(w) for w in unknown)}{where}; it draws one or two "
                f"shapes from these words: {' '.join(known)} (one position per shape; docs/demo.md)")

    def __call__(self, prompt: str) -> List[int]:
        unk = self.index[UNK]
        return [self.index[BOS]] + [self.index.get(w, unk) for w in self.split(prompt)]

    def batch(self, prompts: Sequence[str], max_len: int):
        """ids [B, T] (padded with 0) and lengths [B]; prompts longer than max_len are cut."""
        ids = [self(p)[:max_len] for p in prompts]
        t = max(len(i) for i in ids)
        out = torch.zeros(len(ids), t, dtype=torch.long)
        for b, i in enumerate(ids):
            out[b, : len(i)] = torch.tensor(i)
        return out, torch.tensor([len(i) for i in ids])


@dataclass(frozen=True)
class TextEncoderConfig:
    vocab_size: int
    dim: int = 128
    layers: int = 2
    heads: int = 4
    ffn: int = 256
    max_len: int = 48

    def to_dict(self) -> dict:
        return asdict(self)


class DemoTextEncoder(nn.Module):
    """Token + position embeddings, pre-norm transformer layers, final LayerNorm -> [B, T, dim]."""

    def __init__(self, cfg: TextEncoderConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = nn.Parameter(torch.zeros(cfg.max_len, cfg.dim))
        self.layers = nn.ModuleList([
            nn.TransformerEncoderLayer(cfg.dim, cfg.heads, cfg.ffn, dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True)
            for _ in range(cfg.layers)])
        self.norm = nn.LayerNorm(cfg.dim)
        nn.init.normal_(self.embed.weight, std=0.5)
        nn.init.normal_(self.pos, std=0.1)

    def forward(self, ids: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        h = self.embed(ids) + self.pos[:t]
        pad = torch.arange(t, device=ids.device)[None] >= lens.to(ids.device)[:, None]
        mask = pad if bool(pad.any()) else None
        for layer in self.layers:
            h = layer(h, src_key_padding_mask=mask)
        return self.norm(h)

