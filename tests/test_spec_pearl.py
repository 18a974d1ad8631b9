"""PEARL (impl.spec.pearl): the pre-verify / post-verify schedule on hand-built cycle models (a perfect
draft: one pre-verify, then whole blocks; an always-wrong draft: every round a rejected pre-verify),
exactness against AR (greedy and position-keyed Gumbel sampling, with and without EOS, several
windows, a layer-truncated draft and a perfect draft with real attention), the two-device timeline
and parameter validation."""

import copy
import math

import pytest

from impl.models.draft import truncated_draft
from impl.spec.ar import ar_decode
from impl.spec.pearl import pearl_decode
from impl.spec.sampling import DecodeRule

from test_spec_baselines import _cycle_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

N_NEW = 24
PROMPTS = [[5], [3, 17, 42, 8, 9], list(range(1, 30))]


def _check(res, n_new):
    assert sum(r.committed for r in res.rounds) == len(res.tokens) <= n_new
    for r in res.rounds:
        assert r.kind in ("pre_reject", "pre_accept", "post")
        assert 0 <= r.accepted <= r.drafted
        assert r.critical_layers <= r.layer_work
        assert r.projected_seconds <= r.target_seconds + r.draft_seconds + 1e-12
        assert r.projected_seconds >= r.target_seconds - 1e-12
    assert res.projected_seconds == pytest.approx(sum(r.projected_seconds for r in res.rounds))
    assert res.critical_layers == sum(r.critical_layers for r in res.rounds)


@pytest.mark.parametrize("n,g", [(12, 3), (13, 3), (14, 3), (7, 2)])
def test_perfect_draft_runs_whole_blocks(n, g):
    """Draft = target (a cycle): one pre-verify, then every post-verify commits a whole block while the
    draft has the next one ready (the first token of each block is verified by the round before, so
    the last one is free): 1 + ceil((n - 1) / g) target passes."""
    perm = [(t + 3) % 8 for t in range(8)]
    target, draft = _cycle_model(perm), _cycle_model(perm)
    res = pearl_decode(target, draft, [0, 1, 2], n, gamma=g)
    assert res.tokens == ar_decode(target, [0, 1, 2], n).tokens
    kinds = [r.kind for r in res.rounds]
    assert kinds == ["pre_accept"] + ["post"] * math.ceil((n - 1) / g)
    assert res.target_passes == 1 + math.ceil((n - 1) / g)
    _check(res, n)


def test_window_of_one_is_a_pre_verify_per_token():
    """gamma = 1: the root pass verifies the single draft, so every round is an accepted pre-verify
    committing one token (the draft only hides behind the target's pass)."""
    perm = [(t + 3) % 8 for t in range(8)]
    target = _cycle_model(perm)
    res = pearl_decode(target, _cycle_model(perm), [0, 1, 2], 6, gamma=1)
    assert res.tokens == ar_decode(target, [0, 1, 2], 6).tokens
    assert [(r.kind, r.committed) for r in res.rounds] == [("pre_accept", 1)] * 6 and res.target_passes == 6
    _check(res, 6)


def test_wrong_draft_costs_one_draft_step_per_token():
    """A draft that is always wrong: every round is a rejected pre-verify committing the target's token,
    and the draft runs one step per round, not gamma."""
    target = _cycle_model([(t + 3) % 8 for t in range(8)])
    draft = _cycle_model([(t + 5) % 8 for t in range(8)])  # never the target's next token
    n = 10
    res = pearl_decode(target, draft, [0, 1, 2], n, gamma=4)
    assert res.tokens == ar_decode(target, [0, 1, 2], n).tokens
    assert [r.kind for r in res.rounds] == ["pre_reject"] * n
    assert res.target_passes == n and res.draft_passes == n
    _check(res, n)


@pytest.mark.parametrize("rule", [DecodeRule(), DecodeRule(temperature=1.0, seed=3)], ids=["greedy", "sample"])
@pytest.mark.parametrize("which", ["truncated", "perfect"])
def test_pearl_equals_ar(tiny_model, rule, which):
    draft = truncated_draft(tiny_model, [1, 6, 12]) if which == "truncated" else copy.deepcopy(tiny_model)
    for prompt in PROMPTS:
        ar = ar_decode(tiny_model, prompt, N_NEW, rule=rule).tokens
        eos = ar[N_NEW // 2]
        ar_eos = ar_decode(tiny_model, prompt, N_NEW, rule=rule, eos_token_id=eos).tokens
        for g in (1, 2, 4):
            res = pearl_decode(tiny_model, draft, prompt, N_NEW, gamma=g, rule=rule)
            assert res.tokens == ar, (prompt, g)
            _check(res, N_NEW)
            if which == "perfect" and g > 1:  # the same model, same noise: blocks accepted, with attention
                assert sum(r.accepted for r in res.rounds if r.kind == "post") > 0
            res = pearl_decode(tiny_model, draft, prompt, N_NEW, gamma=g, rule=rule, eos_token_id=eos)
            assert res.tokens == ar_eos and res.stopped_at_eos


def test_pearl_through_decode_prompts(tiny_model, tmp_path):
    from impl.methods import decode_prompts

    truncated_draft(tiny_model, [1, 12]).save_pretrained(tmp_path / "draft")
    rows = decode_prompts(tiny_model, None, [{"id": "a", "input_ids": [3, 17, 42]}], "pearl",
                          {"draft": str(tmp_path / "draft"), "gamma": 3}, DecodeRule(), 12, None)
    assert rows[0]["ar_match"] is True and rows[0]["projected_seconds"] <= rows[0]["seconds"]
    assert sum(rows[0]["rounds_by_kind"].values()) == rows[0]["spec_rounds"]


def test_pearl_bad_parameters(tiny_model):
    with pytest.raises(ValueError, match="gamma"):
        pearl_decode(tiny_model, copy.deepcopy(tiny_model), [1, 2], 4, gamma=0)
    with pytest.raises(ValueError, match="separate model"):
        pearl_decode(tiny_model, tiny_model, [1, 2], 4, gamma=2)
    other = _cycle_model(list(range(8)))
    with pytest.raises(ValueError, match="vocabulary"):
        pearl_decode(tiny_model, other, [1, 2], 4, gamma=2)
    with pytest.raises(ValueError, match="context"):
        pearl_decode(tiny_model, copy.deepcopy(tiny_model), [1 + i % 90 for i in range(99)], 30, gamma=4)
