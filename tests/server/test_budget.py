"""A client's share of the bodies being read (``kembed/frontend/budget.py``): its bodies together
within the share, whatever their order of ending; its neighbours within their own."""

from __future__ import annotations

import pytest

from kembed.domain.errors import EmbedError
from kembed.frontend.budget import ClientShares


def test_a_clients_bodies_together_stay_within_its_share_whichever_ends_first() -> None:
    shares = ClientShares(100)
    with shares.holding("a") as first:
        with shares.holding("a") as second:
            second.grow(60)
            with pytest.raises(EmbedError, match="this client is sending 60 bytes"):
                first.grow(41)
            first.grow(40)
            with shares.holding("b") as neighbour:
                neighbour.grow(100)
        with shares.holding("a") as third, pytest.raises(EmbedError):  # the first still holds its 40
            third.grow(61)
    with shares.holding("a") as again:  # all ended: the whole share
        again.grow(100)


def test_a_body_that_ends_holding_nothing_leaves_its_clients_other_bodies_counted() -> None:
    """A body refused before its first chunk ends holding nothing while another of its client's is
    read (the share was forgotten under it, and its end raised KeyError: a 500)."""
    shares = ClientShares(100)
    with shares.holding("a") as reading:
        with shares.holding("a"):
            pass
        reading.grow(100)
        with shares.holding("a") as another, pytest.raises(EmbedError):
            another.grow(1)
