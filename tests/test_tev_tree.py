"""Draft trees (TEV Sec. 3 fixed-tree setup): validation, structure, ancestor mask, positions, and the
4D mask of one target forward over [committed prefix | tree], checked against per-path forwards."""

import pytest
import torch

from impl.tev.tree import DraftTree, ancestor_mask, path_to, tree_attention_mask, validate_tree


def _tree():
    #        0 (tok 7)
    #       /         \
    #   1 (tok 1)    4 (tok 4)
    #    /    \
    # 2 (2)  3 (3)
    return DraftTree.from_paths([[1, 2], [1, 3], [4]], root_token=7)


def test_from_paths_structure():
    t = _tree()
    assert t.parents == [-1, 0, 1, 1, 0]
    assert t.tokens == [7, 1, 2, 3, 4]
    assert t.depths == [0, 1, 2, 2, 1]
    assert t.children == [[1, 4], [2, 3], [], [], []]
    assert t.max_depth == 2 and len(t) == 5
    assert [lv.tolist() for lv in t.levels()] == [[0], [1, 4], [2, 3]]
    assert t.path_to(3) == [0, 1, 3] and t.path_to(0) == [0]
    assert t.path_tokens(3) == [1, 3] and t.path_tokens(0) == []
    # from_paths merges shared prefixes and accepts repeats
    assert DraftTree.from_paths([[1, 2], [1], [1, 2]]).parents == [-1, 0, 1]


def test_add_child_and_tensor_inputs():
    t = DraftTree.root_only(5)
    a = t.add_child(0, 3)
    b = t.add_child(a, 3)  # same token under a different parent is fine
    assert (a, b) == (1, 2) and t.depths == [0, 1, 2] and t.children == [[1], [2], []]
    t2 = DraftTree(torch.tensor([-1, 0, 1]), torch.tensor([5, 3, 3]))
    assert t2.parents == t.parents and t2.tokens == t.tokens


def test_sibling_tokens_must_be_distinct():
    with pytest.raises(ValueError, match=r"node 3: token 1 repeats"):
        DraftTree([-1, 0, 0, 0], [9, 1, 2, 1])
    t = _tree()
    with pytest.raises(ValueError, match=r"node 5: token 2 repeats sibling node 2"):
        t.add_child(1, 2)
    assert len(t) == 5  # the failed add left the tree unchanged


@pytest.mark.parametrize("parents,tokens,msg", [
    ([], [], "at least the root"),
    ([-1, 0], [0], "parents has 2 entries but tokens has 1"),
    ([0, 0], [0, 1], "node 0 must be the root"),
    ([-1, 2, 0], [0, 1, 2], r"node 1: parent 2 is not an earlier node"),
    ([-1, 0, -1], [0, 1, 2], r"node 2: parent -1"),
    ([-1, 0], [0, -3], r"node 1: draft token must be >= 0"),
    ([-1, 0.5], [0, 1], "must hold integers"),
])
def test_invalid_trees(parents, tokens, msg):
    with pytest.raises(ValueError, match=msg):
        validate_tree(parents, tokens)


def test_ancestor_mask_and_positions():
    t = _tree()
    expected = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 0, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(t.ancestor_mask(), expected)
    assert torch.equal(ancestor_mask(t.parents), expected)
    assert torch.equal(t.position_ids(10), torch.tensor([[10, 11, 12, 12, 11]]))
    assert t.position_ids(0).dtype == torch.long
    with pytest.raises(ValueError, match="prefix_len"):
        t.position_ids(-1)
    # a chain's mask is lower-triangular
    chain = DraftTree.from_paths([[1, 2, 3, 4]])
    assert torch.equal(chain.ancestor_mask(), torch.ones(5, 5, dtype=torch.bool).tril())
    # a star's mask is root column + diagonal
    star = DraftTree([-1, 0, 0, 0], [0, 1, 2, 3])
    m = torch.eye(4, dtype=torch.bool)
    m[:, 0] = True
    assert torch.equal(star.ancestor_mask(), m)


def test_4d_mask_layout():
    t = _tree()
    m = t.attention_mask(3)
    assert m.shape == (1, 1, 5, 8) and m.dtype == torch.bool
    assert m[0, 0, :, :3].all()  # the committed prefix is fully visible
    assert torch.equal(m[0, 0, :, 3:], t.ancestor_mask())
    assert torch.equal(tree_attention_mask(t.parents, 0), t.ancestor_mask()[None, None])
    assert path_to(torch.tensor(t.parents), 2) == [0, 1, 2]
    with pytest.raises(ValueError, match="root token is -1"):
        DraftTree.from_paths([[1]]).input_ids()


def test_tree_forward_matches_per_path_forwards(tiny_model):
    """One forward over the tree with the 4D mask and prefix_len + depth positions gives, at every
    node v, the target logits after the committed context followed by pi(v) (Eq. 1)."""
    from transformers import DynamicCache

    committed = [3, 1, 4, 1, 5, 9]
    t = DraftTree.from_paths([[2, 6, 5], [2, 7], [8, 8], [11]], root_token=committed[-1])
    prefix_len = len(committed) - 1
    with torch.no_grad():
        cache = DynamicCache(config=tiny_model.config)
        tiny_model(input_ids=torch.tensor([committed[:-1]]), cache=cache, use_cache=True)
        tree_logits = tiny_model(
            input_ids=t.input_ids(), attention_mask=t.attention_mask(prefix_len),
            position_ids=t.position_ids(prefix_len), cache=cache, use_cache=True).logits[0]
        for v in range(len(t)):
            ref = tiny_model(input_ids=torch.tensor([committed + t.path_tokens(v)])).logits[0, -1]
            torch.testing.assert_close(tree_logits[v], ref, atol=1e-4, rtol=1e-4)
    # the mask matters: a plain causal forward over the flattened tree gives different rows
    with torch.no_grad():
        flat = tiny_model(input_ids=torch.tensor([committed + t.tokens[1:]])).logits[0, -1]
    assert not torch.allclose(flat, tree_logits[-1], atol=1e-3)
