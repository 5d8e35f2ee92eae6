"""Token batches with structure, for benchmarks whose numbers depend on what the data looks like (a
loss that falls, a gradient norm that moves, the same tokens recurring), where uniform noise would not
do: benchmarks/clipping/redo_rate.py, benchmarks/train_gpt/tied_rows.py."""

from __future__ import annotations

import torch


class MarkovText:
    """Batches of a fixed random Markov chain over the vocabulary: each token is followed by one of
    `successors` tokens (drawn once), with Zipf-like probabilities."""

    def __init__(self, vocab: int, successors: int = 4, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.next_tokens = torch.randint(0, vocab, (vocab, successors), generator=g)
        weights = 1.0 / torch.arange(1, successors + 1, dtype=torch.float64)
        self.probabilities = (weights / weights.sum()).expand(vocab, successors)
        self.vocab = vocab

    def batch(self, step: int, batch: int, seq: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 + step)
        tokens = torch.empty(batch, seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, self.vocab, (batch,), generator=g)
        for t in range(seq):
            choice = torch.multinomial(self.probabilities[tokens[:, t]], 1, generator=g).squeeze(1)
            tokens[:, t + 1] = self.next_tokens[tokens[:, t], choice]
        return tokens
