"""``RoundPipe.load_state_dict`` keys: what ``nn.Module.load_state_dict`` returns, and a
state keyed for another object (the wrapped model's own names) refused instead of
loading nothing."""

from __future__ import annotations

import copy

import pytest
import torch

import rotapipe
from models import emulated, lm_loss, tiny_transformer


def test_a_state_with_none_of_the_pipelines_keys_is_refused_also_non_strict():
    """The wrapped model's own names (here ``model.``-prefixed, as a Hugging Face
    ``save_pretrained`` file is keyed) with ``strict=False`` used to load nothing and
    return ``None``: training went on from the old weights, silently."""
    model = tiny_transformer(widths=(24, 40))
    other = {"model." + k: v + 1 for k, v in tiny_transformer(widths=(24, 40)).state_dict().items()}
    with rotapipe.RoundPipe(model, lm_loss, config=emulated(2, 2)) as pipe:
        before = {k: v.clone() for k, v in pipe.state_dict().items()}
        for strict in (True, False):
            with pytest.raises(rotapipe.ConfigError, match=r"none of the \d+ keys is one of "
                               r"the pipeline's \(given 'model\.0\.emb\.weight', .*'0\.emb"
                               r"\.weight'.*model\.load_state_dict\(state\)"):
                pipe.load_state_dict(other, strict=strict)
        for k, v in pipe.state_dict().items():
            assert torch.equal(v, before[k]), k


def test_load_state_dict_returns_the_missing_and_unexpected_keys():
    """As ``nn.Module.load_state_dict``: ``strict=False`` tells what it skipped."""
    model = tiny_transformer(widths=(24, 40))
    twin = copy.deepcopy(model)
    partial = {k: v for k, v in tiny_transformer(widths=(24, 40), seed=2).state_dict().items()
               if k.startswith("1.")}
    partial["extra.weight"] = torch.zeros(1)
    want = twin.load_state_dict(partial, strict=False)
    with rotapipe.RoundPipe(model, lm_loss, config=emulated(2, 2)) as pipe:
        got = pipe.load_state_dict(partial, strict=False)
        assert got.missing_keys == want.missing_keys
        assert got.unexpected_keys == want.unexpected_keys == ["extra.weight"]
        full = pipe.load_state_dict(twin.state_dict())
        assert full.missing_keys == full.unexpected_keys == []
        for k, v in pipe.state_dict().items():
            assert torch.equal(v, twin.state_dict()[k]), k
