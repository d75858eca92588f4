"""``addons_compat.DotTree`` / ``NamedTensors`` against popxl.addons' ordering rules.

Upstream (popxl_addons/dot_tree.py, named_tensors.py) is the contract: ``to_dict``
keeps insertion order, ``unpack`` sorts by key, ``NamedTensors.tensors`` sorts by
tensor name and ``NamedVariableFactories.init`` creates in sorted key order.
"""
from __future__ import annotations

import numpy as np
import pytest

import ipuxl
from ipuxl.addons_compat import DotTree, NamedTensors, to_mapping
from ipuxl.errors import InvalidArgumentError, NameConflictError


def _tree() -> DotTree:
    """``{'b': 1, 'a.y': 2, 'a.x': 3}``: insertion order differs from sorted order."""
    tree = DotTree()
    tree.insert("b", 1)
    tree.insert("a.y", 2)
    tree.insert("a.x", 3, overwrite=True)  # 'a' exists: merging into it needs overwrite
    return tree


# -- insert ----------------------------------------------------------------------------
def test_insert_dotted_key_builds_nested_trees():
    tree = DotTree()
    tree.insert("fc1.weight", "w1")
    tree.insert("fc1.bias", "b1", overwrite=True)  # 'fc1' exists: merging needs overwrite, as upstream
    tree.insert("enc.layer.weight", "w2")
    assert isinstance(tree.fc1, DotTree) and isinstance(tree.enc.layer, DotTree)
    assert tree.fc1.weight == "w1" and tree.fc1.bias == "b1" and tree.enc.layer.weight == "w2"
    assert tree.keys() == ["fc1", "enc"]
    assert tree.to_dict() == {"fc1.weight": "w1", "fc1.bias": "b1", "enc.layer.weight": "w2"}


def test_insert_into_existing_subtree_keeps_the_subtree_object():
    tree = DotTree()
    tree.insert("fc1.weight", 1)
    sub = tree.fc1
    tree.insert("fc1.bias", 2, overwrite=True)
    assert tree.fc1 is sub and sub.to_dict() == {"weight": 1, "bias": 2}


def test_insert_numeric_keys_int_and_str():
    tree = DotTree()
    tree.insert(0, "zero")
    tree.insert("1", "one")
    tree.insert("2.w", "nested")
    assert tree.keys() == ["0", "1", "2"]
    assert tree[0] == "zero" and tree["0"] == "zero" and tree.get(1) == "one"
    assert tree[2].w == "nested"


def test_insert_negative_int_key_raises():
    with pytest.raises(ValueError, match="negative"):
        DotTree().insert(-1, "x")


def test_insert_overwrite_replaces_leaf():
    tree = _tree()
    tree.insert("b", 10, overwrite=True)
    tree.insert("a.x", 30, overwrite=True)
    assert tree.to_dict() == {"b": 10, "a.y": 2, "a.x": 30}


def test_insert_duplicate_key_raises_name_conflict_and_changes_nothing():
    tree = _tree()
    before = tree.to_dict()
    with pytest.raises(NameConflictError, match="'b' already exists"):
        tree.insert("b", 5)
    with pytest.raises(NameConflictError, match="'a' already exists"):
        tree.insert("a.x", 5)
    with pytest.raises(NameConflictError):  # a leaf cannot silently become a subtree
        tree.insert("b.c", 5)
    assert tree.to_dict() == before


@pytest.mark.parametrize("key", ["a-b", "1a", "has space", "", "a.-"])
def test_insert_invalid_identifier_raises(key):
    tree = DotTree()
    with pytest.raises(ValueError, match="not a valid Python identifier"):
        tree.insert(key, 1)
    assert tree.to_dict() == {}  # a failed nested insert leaves no empty subtree behind


def test_kwargs_constructor():
    tree = DotTree(foo="bar", baz=1)
    assert tree.foo == "bar" and tree.to_dict() == {"foo": "bar", "baz": 1}


# -- get / [] / attributes ---------------------------------------------------------------
def test_get_item_and_attribute_access():
    tree = _tree()
    assert tree.get("b") == tree["b"] == tree.b == 1
    assert tree.a.x == tree["a"]["x"] == 3
    with pytest.raises(KeyError):
        tree.get("missing")
    with pytest.raises(KeyError):
        tree["missing"]
    with pytest.raises(AttributeError):
        tree.missing
    assert not hasattr(tree, "missing")


def test_negative_numeric_keys_count_from_the_largest_numeric_key():
    tree = DotTree()
    for i in (0, 1, 3):
        tree.insert(i, f"v{i}")
    tree.insert("name", "n")
    assert tree[-1] == "v3"  # max numeric key + 1 - 1
    assert tree[-3] == "v1"
    assert tree[-4] == "v0"
    with pytest.raises(KeyError):
        tree[-2]  # equivalent positive key 2 does not exist
    with pytest.raises(KeyError):
        tree[-5]  # before the first key
    with pytest.raises(KeyError):
        tree[7]


# -- update / pop / copy -------------------------------------------------------------------
def test_update_merges_and_rejects_duplicates_unless_overwrite():
    tree = _tree()
    tree.update(DotTree.from_dict({"c": 4, "d.e": 5}))
    assert tree.to_dict() == {"b": 1, "a.y": 2, "a.x": 3, "c": 4, "d.e": 5}
    with pytest.raises(NameConflictError):
        tree.update(DotTree.from_dict({"c": 40}))
    tree.update(DotTree.from_dict({"c": 40}), overwrite=True)
    assert tree.c == 40


def test_update_does_not_alias_the_source_subtrees():
    tree, other = DotTree(), DotTree.from_dict({"d.e": 5})
    tree.update(other)
    tree.insert("d.f", 6, overwrite=True)
    assert other.to_dict() == {"d.e": 5}


def test_pop_removes_top_level_key():
    tree = _tree()
    sub = tree.pop("a")
    assert isinstance(sub, DotTree) and sub.to_dict() == {"y": 2, "x": 3}
    assert tree.to_dict() == {"b": 1}
    with pytest.raises(KeyError):
        tree.pop("a")


def test_copy_copies_structure_and_shares_leaves():
    leaf = object()
    tree = DotTree.from_dict({"a.leaf": leaf, "b": 1})
    copied = tree.copy()
    assert type(copied) is DotTree
    assert copied.a is not tree.a
    assert copied.a.leaf is leaf
    copied.insert("a.new", 2, overwrite=True)
    copied.insert("c", 3)
    assert tree.to_dict() == {"a.leaf": leaf, "b": 1}
    assert NamedTensors.from_dict({"x": 1}).copy().__class__ is NamedTensors


# -- views ----------------------------------------------------------------------------------
def test_keys_values_and_lengths():
    tree = _tree()
    assert tree.keys() == ["b", "a"]
    assert tree.keys_flat() == ["b", "a.y", "a.x"]
    assert tree.values()[0] == 1 and tree.values()[1] is tree.a
    assert tree.values_flat() == [1, 2, 3]
    assert tree.len() == 2
    assert tree.len_flat() == 3


def test_to_dict_keeps_insertion_order_and_from_dict_inverts_it():
    tree = _tree()
    assert list(tree.to_dict().items()) == [("b", 1), ("a.y", 2), ("a.x", 3)]
    rebuilt = DotTree.from_dict(tree.to_dict())
    assert list(rebuilt.to_dict().items()) == list(tree.to_dict().items())
    assert rebuilt.a.x == 3
    assert DotTree.from_dict({0: "z", "1.w": "n"}).to_dict() == {"0": "z", "1.w": "n"}
    assert type(NamedTensors.from_dict({"a": 1})) is NamedTensors


def test_unpack_sorts_by_key_and_pack_inverts_it():
    tree = DotTree.from_dict({"b": 1, "a.y": 2, "a.x": 3, "10": 4, "2": 5})
    keys, values = tree.unpack()
    assert list(keys) == ["10", "2", "a.x", "a.y", "b"]  # string order, as upstream
    assert list(values) == [4, 5, 3, 2, 1]
    packed = DotTree.pack(keys, values)
    assert packed.to_dict() == dict(zip(keys, values))
    assert packed.a.y == 2
    assert [list(x) for x in DotTree().unpack()] == [[], []]


def test_map_applies_to_every_leaf_and_keeps_the_class():
    tree = NamedTensors.from_dict({"b": 1, "a.y": 2})
    doubled = tree.map(lambda v: v * 2)
    assert type(doubled) is NamedTensors
    assert doubled.to_dict() == {"b": 2, "a.y": 4}
    assert tree.to_dict() == {"b": 1, "a.y": 2}


# -- to_mapping -------------------------------------------------------------------------------
def test_to_mapping_maps_leaves_of_common_keys():
    keys = DotTree.from_dict({"fc1.w": "K1", "fc1.b": "K2", "only_left": "K3"})
    values = DotTree.from_dict({"fc1.b": "V2", "fc1.w": "V1", "only_right": "V4"})
    assert keys.to_mapping(values) == {"K1": "V1", "K2": "V2"}
    assert to_mapping(keys, values) == {"K1": "V1", "K2": "V2"}


def test_to_mapping_without_common_keys_raises():
    with pytest.raises(InvalidArgumentError, match="no key in common"):
        DotTree.from_dict({"a": 1}).to_mapping(DotTree.from_dict({"b": 2}))
    assert DotTree().to_mapping(DotTree.from_dict({"b": 2})) == {}


# -- NamedTensors ------------------------------------------------------------------------------
def _main_graph_tensors():
    ir = ipuxl.Ir()
    with ir.main_graph:
        zed = ipuxl.variable(np.zeros(2, np.float32), name="zed")
        alpha = ipuxl.variable(np.ones(3, np.float32), name="alpha")
        mid = ipuxl.constant(np.ones(1, np.float32), name="mid")
        inter = alpha + 1.0
    return ir, zed, alpha, mid, inter


def test_named_tensors_tensors_sorted_by_tensor_name_not_key():
    _, zed, alpha, mid, _ = _main_graph_tensors()
    nt = NamedTensors.from_dict({"a": zed, "b.c": mid, "c": alpha})
    assert [t.name for t in nt.tensors] == ["alpha", "mid", "zed"]
    assert nt.tensors == (alpha, mid, zed)
    assert nt.named_tensors == {"a": zed, "b.c": mid, "c": alpha}
    assert list(nt.named_tensors) == ["a", "b.c", "c"]


def test_named_tensors_variables_excludes_constants_and_intermediates():
    _, zed, alpha, mid, inter = _main_graph_tensors()
    nt = NamedTensors.from_dict({"a": zed, "b": mid, "c": alpha, "d": inter})
    assert nt.variables == (alpha, zed)
    assert nt.named_variables == {"a": zed, "c": alpha}


def test_named_tensors_remap():
    _, zed, alpha, mid, inter = _main_graph_tensors()
    nt = NamedTensors.from_dict({"x.p": zed, "y": alpha})
    remapped = nt.remap({zed: mid, alpha: inter})
    assert type(remapped) is NamedTensors
    assert remapped.named_tensors == {"x.p": mid, "y": inter}
    assert nt.named_tensors == {"x.p": zed, "y": alpha}
    with pytest.raises(KeyError):
        nt.remap({zed: mid})


def test_seed002_dot_tree_example():
    """Seed 002's "DotTree example" block: a collection of two inits of Linear's factories."""
    import ipuxl.addons_compat as addons

    class Linear(addons.Module):
        def build(self, x):
            w = self.add_variable_input("weight", lambda: np.zeros((x.shape[-1], 32)), x.dtype)
            b = self.add_variable_input("bias", lambda: np.zeros(32), x.dtype)
            return x @ w + b

    ir = ipuxl.Ir(replication=1)
    with ir.main_graph:
        facts, _ = Linear().create_graph(ipuxl.TensorSpec((2, 4), ipuxl.float32))
        variables, variables2 = facts.init(), facts.init()
        collection = addons.NamedTensors()
        collection.insert("layer1", variables)
        collection.insert("layer2", variables2)
        assert list(collection.to_dict()) == ["layer1.bias", "layer1.weight", "layer2.bias", "layer2.weight"]
        assert collection.layer1.to_dict() == {"bias": variables.bias, "weight": variables.weight}
        assert collection.named_tensors == collection.to_dict()
        # upstream prints (bias, bias__t0, weight, weight__t1): layer1 then layer2 for each name
        assert collection.tensors == (variables.bias, variables2.bias, variables.weight, variables2.weight)
        x = ipuxl.variable(np.zeros((2, 4), np.float32), name="x")
        nt = addons.NamedTensors.from_dict({"x": x})
        nt.update(addons.NamedTensors.from_dict({"b": variables.bias}))
        assert nt.named_tensors == {"x": x, "b": variables.bias}
        nt_from_lists = addons.NamedTensors.pack(["new_bias_name", "new_weight_name"], variables.tensors)
        names, tensors = nt_from_lists.unpack()
        assert list(names) == ["new_bias_name", "new_weight_name"]
        assert list(tensors) == [variables.bias, variables.weight]


def test_filter_keys_keeps_named_leaves_and_subtrees():
    tree = DotTree.from_dict({"a.x": 1, "a.y": 2, "b": 3, "c.z": 4})
    kept = tree.filter_keys(["a", "b"])
    assert kept.to_dict() == {"a.x": 1, "a.y": 2, "b": 3}
    assert tree.filter_keys(["c.z"]).to_dict() == {"c.z": 4}


def test_clear_removes_leaves_but_keeps_subtree_objects():
    tree = DotTree.from_dict({"a.x": 1, "b": 3})
    sub = tree.a
    tree._clear()
    assert tree.to_dict() == {} and tree.a is sub
