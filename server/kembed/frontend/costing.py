"""What a call costs the engine, in padded tokens (each item padded to its bucket), twice: a lower
bound from the call and its plan before it is tokenized, for the pre-screen, and exactly once its
items are known, for admission.

The bound is exact for pre-tokenized ids and counts words for texts (``Tokenizer.least_lengths``):
a pre-screen refuses what the server cannot take before it costs a tokenization.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kembed.domain.inputs import Sequences, Tokenizer
from kembed.frontend.call import EmbedCall
from kembed.frontend.preparing import Plan
from kembed.policy.shapes import padded_tokens

# The weight of each call in the average of its padded cost over its pre-screen bound.
COST_RATIO_WEIGHT = 0.05
# Counting words for the pre-screen costs a fiftieth of tokenizing; above this many characters a
# request's words are not counted on the event loop, and it is pre-screened at one token an item.
WORD_COUNT_LIMIT = 65536


class Costing:
    """Costs in padded tokens, and how far this front end's exact costs have run above their bounds."""

    def __init__(self, tokenizer: Tokenizer, bucket_lengths: Sequence[int], max_items: int) -> None:
        self._tokenizer = tokenizer
        self._bucket_lengths = list(bucket_lengths)
        self._max_items = max_items
        self._cost_over_least = 1.0  # padded cost over its pre-screen bound, averaged over calls

    def least(self, call: EmbedCall, plan: Plan) -> int:
        """A lower bound of the call's padded cost, read without tokenizing. Chunked, it counts the
        chunks, and a call that would need more than a request holds is refused here."""
        limit = plan.limit
        inputs = call.inputs
        if isinstance(inputs, Sequences):
            lengths = np.clip(inputs.lengths, 1, limit.tokens)
        elif inputs.chars <= WORD_COUNT_LIMIT:
            lengths = self._tokenizer.least_lengths(inputs.items, limit, plan.prompt.tokens)
        else:
            lengths = np.full(call.count, min(1 + plan.prompt.tokens, limit.tokens), dtype=np.int64)
        if (chunking := plan.chunking) is not None:
            lengths = chunking.lengths(lengths, chunking.check(lengths, self._max_items))
        return self.padded(lengths)

    def screened(self, least: int, paced: bool) -> int:
        """The cost the pre-screen weighs: the lower bound, or, for a client whose refusals are being
        ``paced`` (it ignores its pushback), the bound scaled to what this front end's calls have
        cost, so that its calls at the margin are refused before a tokenization, not after one."""
        if paced:
            return max(least, int(least * self._cost_over_least))
        return least

    def exact(self, lengths: np.ndarray, least: int) -> int:
        """The padded cost of items of these ``lengths``, learnt against the call's bound."""
        cost = self.padded(lengths)
        self._cost_over_least += COST_RATIO_WEIGHT * (cost / max(1, least) - self._cost_over_least)
        return cost

    def padded(self, lengths: np.ndarray) -> int:
        """What items of these lengths cost once each is padded to its bucket."""
        return padded_tokens(lengths, self._bucket_lengths)
