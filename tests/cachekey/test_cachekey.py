"""CacheKey and BlockIndex: stable digests, sensitivity to every field, block chains, lookup."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcopy.cachekey import FORMAT_VERSION, BlockIndex, CacheKey, SupportsIdentity

ROOT = Path(__file__).resolve().parents[2]


def _identity() -> dict:
    return {
        "name": "llama-3-8b",
        "num_layers": 32,
        "num_kv_heads": 8,
        "head_dim": 128,
        "kv_dtype": "bfloat16",
        "attention": "gqa",
        "layer_types": ["full_attention", "sliding_attention"],
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }


TOKENIZER = "meta-llama/Meta-Llama-3-8B@r1"


WEIGHTS = "meta-llama/Meta-Llama-3-8B@5f0b02c"


def _key(model=None, **kw) -> CacheKey:
    kw.setdefault("tokenizer", TOKENIZER)
    kw.setdefault("weights_id", WEIGHTS)
    kw.setdefault("block_tokens", 4)
    return CacheKey(_identity() if model is None else model, **kw)


class _Spec:
    """A stand-in for kvcopy.ModelSpec: anything with identity() -> dict."""

    def __init__(self, identity: dict) -> None:
        self._identity = identity

    def identity(self) -> dict:
        return dict(self._identity)


# --------------------------------------------------------------------------- stability

# Computed once with the code under test and pasted here: a change to the encoding
# must change FORMAT_VERSION (and these digests), never silently alter hashes.
_STABLE_SCRIPT = """
import json
from kvcopy.cachekey.key import CacheKey
m = {"name": "llama-3-8b", "num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "kv_dtype": "bfloat16",
     "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
k = CacheKey(m, weights_id="meta-llama/Meta-Llama-3-8B@5f0b02c", block_tokens=4)
print(json.dumps([k.context_hash, k.block_hashes(list(range(10)))]))
"""
EXPECTED_CONTEXT = "d50263df43b687b586bca0f254342fed46b503bc36ac3dc6f2559e1ab660b126"
EXPECTED_BLOCKS = [
    "df2f86367f1ba856c581fbd883129729e543ffa8eec5831b961ffc38cfd4eb9d",
    "1158ace77fb0a21d577e1285b711e2487cb8e9c281a24af174981fba0c7d1027",
]


def test_digest_is_hard_coded_value():
    namespace: dict = {}
    exec(_STABLE_SCRIPT.replace("print(", "result = ("), namespace)
    assert json.loads(namespace["result"]) == [EXPECTED_CONTEXT, EXPECTED_BLOCKS]


@pytest.mark.slow
def test_digest_is_the_same_in_a_fresh_process():
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", _STABLE_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [EXPECTED_CONTEXT, EXPECTED_BLOCKS]


def test_digest_follows_the_documented_encoding():
    """Recomputed here from the spec: sha256 of canonical JSON, then a chain over int64 LE tokens."""
    key = _key({"name": "m", "kv_dtype": "fp8_e4m3"}, block_tokens=2, rope_theta=10000)
    payload = (
        '{"adapter":null,"block_tokens":2,"domain":"kvcopy.CacheKey","format":2,"kv_dtype":"fp8_e4m3",'
        '"model_identity":{"name":"m"},"rope_scaling":null,"rope_theta":10000,"scale_policy":"none",'
        '"scales":null,"tp_rank":0,"tp_size":1,"weights_id":"meta-llama/Meta-Llama-3-8B@5f0b02c"}'
    )
    context = hashlib.sha256(payload.encode("ascii")).digest()
    assert key.context_hash == context.hex()
    h0 = hashlib.sha256(context + (7).to_bytes(8, "little") + (-1).to_bytes(8, "little", signed=True)).digest()
    h1 = hashlib.sha256(h0 + (2**40).to_bytes(8, "little") + (0).to_bytes(8, "little")).digest()
    assert key.block_hashes([7, -1, 2**40, 0, 5]) == [h0.hex(), h1.hex()]


# --------------------------------------------------------------------------- sensitivity


def _with(**changes) -> dict:
    identity = _identity()
    identity.update(changes)
    return identity


SENSITIVE = {
    "num_layers": lambda: _key(_with(num_layers=31)),
    "num_kv_heads": lambda: _key(_with(num_kv_heads=4)),
    "head_dim": lambda: _key(_with(head_dim=64)),
    "model name": lambda: _key(_with(name="llama-3.1-8b")),
    "layer_types": lambda: _key(_with(layer_types=["sliding_attention", "full_attention"])),
    "new identity entry": lambda: _key(_with(sliding_window=4096)),
    "weights_id": lambda: _key(weights_id=WEIGHTS + "-finetuned"),
    "scales": lambda: _key(scales=torch.tensor([0.5, 0.25])),
    "scale fingerprint": lambda: _key(scales="sha256:abc"),
    "tp": lambda: _key(_with(tp=2)),
    "tp_rank": lambda: _key(_with(tp=2), tp_rank=1),
    "rope_theta in identity": lambda: _key(_with(rope_theta=10000.0)),
    "rope_theta override": lambda: _key(rope_theta=1_000_000.0),
    "rope_scaling factor": lambda: _key(_with(rope_scaling={**_identity()["rope_scaling"], "factor": 16.0})),
    "rope_scaling override None": lambda: _key(rope_scaling=None),
    "adapter": lambda: _key(adapter="lora:sql@sha256:abc"),
    "kv_dtype in identity": lambda: _key(_with(kv_dtype="float8_e4m3fn")),
    "kv_dtype override": lambda: _key(kv_dtype="float8_e5m2"),
    "scale_policy": lambda: _key(scale_policy="per-block fp8 scales"),
    "block_tokens": lambda: _key(block_tokens=8),
}


@pytest.mark.parametrize("field", sorted(SENSITIVE))
def test_changing_one_field_changes_the_key_and_every_block(field):
    base, changed = _key(), SENSITIVE[field]()
    assert changed != base and changed.context_hash != base.context_hash
    tokens = list(range(100, 132))
    base_blocks = set(base.block_hashes(tokens))
    assert not base_blocks & set(changed.block_hashes(tokens))
    index = BlockIndex()
    index.insert(base.block_hashes(tokens), list(range(len(base_blocks))))
    assert index.match(changed.block_hashes(tokens)) == []  # a lookup under a changed key is a miss


def test_all_sensitive_keys_are_distinct():
    digests = [make().context_hash for make in SENSITIVE.values()] + [_key().context_hash]
    assert len(set(digests)) == len(digests)


def test_adapters_differ_from_each_other():
    assert _key(adapter="lora:a@1") != _key(adapter="lora:a@2")


@pytest.mark.parametrize("position", [0, 1, 3, 4, 7, 8, 11])
def test_changing_one_token_changes_its_block_and_all_later_ones(position):
    key = _key()
    tokens = list(range(12))
    changed = list(tokens)
    changed[position] += 1
    a, b = key.block_hashes(tokens), key.block_hashes(changed)
    block = position // key.block_tokens
    assert a[:block] == b[:block]
    assert all(x != y for x, y in zip(a[block:], b[block:], strict=True))


def test_dict_ordering_does_not_matter():
    identity = _identity()
    reordered = dict(reversed(list(identity.items())))
    reordered["rope_scaling"] = dict(reversed(list(identity["rope_scaling"].items())))
    assert _key(reordered) == _key(identity)
    assert _key(rope_scaling={"b": 1, "a": 2}) == _key(rope_scaling={"a": 2, "b": 1})


def test_equal_numbers_encode_the_same():
    assert _key(_with(rope_theta=500000)) == _key(_with(rope_theta=500000.0))
    assert _key(_with(num_layers=np.int64(32))) == _key()
    assert _key(_with(layer_types=("full_attention", "sliding_attention"))) == _key()
    assert _key(rope_scaling={"factor": 8}) == _key(rope_scaling={"factor": 8.0})
    assert _key(rope_scaling={"factor": 8.5}) != _key(rope_scaling={"factor": 8.25})


def test_overrides_equal_to_the_model_values_give_the_same_key():
    identity = _identity()
    same = _key(rope_theta=identity["rope_theta"], rope_scaling=identity["rope_scaling"], kv_dtype=identity["kv_dtype"])
    assert same == _key()
    # The key depends on the value in effect, wherever it came from.
    assert _key(rope_theta=10000.0) == _key(_with(rope_theta=10000.0))
    assert _key(kv_dtype=torch.bfloat16) == _key()


def test_model_object_and_dict_agree():
    assert isinstance(_Spec(_identity()), SupportsIdentity)
    assert _key(_Spec(_identity())) == _key(_identity())


# --------------------------------------------------------------------------- blocks


def test_shared_prefix_matches_block_by_block():
    key = _key()
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [5, 6, 7, 9]
    ab, ac = key.block_hashes(a + b), key.block_hashes(a + c)
    assert ab[0] == ac[0] == key.block_hashes(a)[0]
    assert ab[1] != ac[1]
    index = BlockIndex()
    index.insert(ab, [10, 11])
    assert index.match(ac) == [10]
    assert index.match(ab) == [10, 11]


def test_partial_trailing_block_is_not_hashed():
    key = _key()
    assert key.block_hashes([]) == []
    assert key.block_hashes([1, 2, 3]) == []
    full = key.block_hashes(list(range(8)))
    assert len(full) == 2
    assert key.block_hashes(list(range(11))) == full
    assert key.block_hashes([*range(8), 99, 98, 97]) == full
    assert key.num_full_blocks(11) == 2


def test_token_containers_and_dtypes_agree():
    key = _key()
    tokens = [0, 5, 128000, 2**31 - 1, 3, 9, 2**62, -3]
    expected = key.block_hashes(tokens)
    for dtype in (np.int64, np.int32, np.uint64):
        values = [t for t in tokens if np.iinfo(dtype).min <= t <= np.iinfo(dtype).max]
        assert key.block_hashes(np.array(values, dtype=dtype)) == key.block_hashes(values)
    assert key.block_hashes(np.array(tokens, dtype=">i8")) == expected  # big-endian input, same hashes
    assert key.block_hashes(torch.tensor(tokens, dtype=torch.int64)) == expected
    assert key.block_hashes(tuple(tokens)) == expected
    assert key.block_hashes([np.int64(t) for t in tokens]) == expected
    small = [1, 2, 3, 4]
    assert key.block_hashes(torch.tensor(small, dtype=torch.int32)) == key.block_hashes(small)
    assert key.block_hashes(np.arange(16)[::2]) == key.block_hashes(list(range(0, 16, 2)))  # strided view


def test_parent_continues_the_chain():
    key = _key()
    tokens = list(range(30))
    hashes = key.block_hashes(tokens)
    for n in range(1, len(hashes)):
        assert key.block_hashes(tokens[n * 4 :], parent=hashes[n - 1]) == hashes[n:]


# --------------------------------------------------------------------------- persistence, dunder


def test_to_dict_round_trips_through_json():
    key = _key(adapter="lora:x@1", scale_policy="per-tensor", rope_theta=123.5)
    data = json.loads(json.dumps(key.to_dict()))
    assert data["format"] == FORMAT_VERSION and data["context_hash"] == key.context_hash
    assert "rope_theta" not in data["model_identity"] and "kv_dtype" not in data["model_identity"]
    again = CacheKey.from_dict(data)
    assert again == key and hash(again) == hash(key)
    assert again.block_hashes(range(8)) == key.block_hashes(range(8))
    assert (again.adapter, again.scale_policy, again.rope_theta) == ("lora:x@1", "per-tensor", 123.5)


def test_from_dict_refuses_bad_records():
    data = _key().to_dict()
    with pytest.raises(ValueError, match="context_hash"):
        CacheKey.from_dict({**data, "weights_id": "other"})
    with pytest.raises(ValueError, match="tp_size"):
        CacheKey.from_dict({**data, "tp_size": 2})
    with pytest.raises(ValueError, match="format"):
        CacheKey.from_dict({**data, "format": FORMAT_VERSION + 1})
    with pytest.raises(ValueError, match="unknown"):
        CacheKey.from_dict({**data, "extra": 1})
    with pytest.raises(ValueError, match="missing"):
        CacheKey.from_dict({k: v for k, v in data.items() if k != "adapter"})


def test_eq_hash_repr():
    a, b = _key(), _key()
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != _key(adapter="x") and a != a.context_hash
    text = repr(a)
    assert text.startswith("CacheKey(" + a.context_hash[:12]) and len(text) < 120
    assert a.model_identity["num_layers"] == 32
    a.model_identity["num_layers"] = 1  # a copy: the key cannot be changed through it
    assert a == b


# --------------------------------------------------------------------------- weights, ranks, scales, extra keys


def test_the_tokenizer_is_recorded_but_not_hashed():
    """The blocks hash token ids: the same ids are the same KV whatever tokenizer made them."""
    a, b = _key(tokenizer="tok-a"), _key(tokenizer="tok-b")
    assert a == b and a.block_hashes(range(8)) == b.block_hashes(range(8))
    assert a.tokenizer == "tok-a" and a.to_dict()["tokenizer"] == "tok-a"
    assert _key(tokenizer=None) == a


def test_a_name_with_a_revision_identifies_the_weights():
    named = _key(_with(name="meta-llama/Meta-Llama-3-8B@5f0b02c"), weights_id=None)
    assert named.weights_id == "meta-llama/Meta-Llama-3-8B@5f0b02c"
    for bare in ("llama-3-8b", "llama", "/models/my-finetune", "@"):
        with pytest.raises(ValueError, match="does not identify its weights"):
            _key(_with(name=bare), weights_id=None)


def test_weights_fingerprint_tells_checkpoints_apart(tmp_path):
    from kvcopy.cachekey.key import weights_fingerprint

    base, tuned = tmp_path / "base", tmp_path / "tuned"
    for folder, seed in ((base, 0), (tuned, 1)):
        folder.mkdir()
        rng = np.random.default_rng(seed)
        (folder / "model-00001.safetensors").write_bytes(b"header" + rng.bytes(3 << 20))
        (folder / "config.json").write_text("{}")  # not a checkpoint file: not read
    assert weights_fingerprint(base) == weights_fingerprint(base)
    assert weights_fingerprint(base) != weights_fingerprint(tuned)
    (base / "config.json").write_text('{"changed": true}')
    first = weights_fingerprint(base)
    assert first == weights_fingerprint(base)
    with pytest.raises(FileNotFoundError, match="no checkpoint files"):
        weights_fingerprint(tmp_path / "nowhere")
    assert _key(weights_id=first) != _key(weights_id=weights_fingerprint(tuned))


def test_each_tensor_parallel_rank_has_its_own_key():
    keys = {_key(_with(tp=4), tp_rank=rank).context_hash for rank in range(4)}
    assert len(keys) == 4
    assert _key(_with(tp=4)).tp_size == 4 and _key().tp_size == 1


def test_scales_are_part_of_the_key():
    scales = torch.tensor([0.5, 0.25, 2.0])
    assert _key(scales=scales) == _key(scales=scales.clone())
    assert _key(scales=scales) != _key(scales=scales * 2)
    assert _key(scales=scales) != _key()
    assert _key(scales=scales.numpy().tobytes()) == _key(scales=scales)  # bytes hash like the tensor's


def test_extra_keys_chain_into_their_block_and_every_later_one():
    key = _key()
    tokens = list(range(12))  # 3 blocks of 4
    plain = key.block_hashes(tokens)
    assert key.block_hashes(tokens, extra_keys=[None, None, None]) == plain
    image = key.block_hashes(tokens, extra_keys=[None, "image:sha256:aa", None])
    other = key.block_hashes(tokens, extra_keys=[None, "image:sha256:bb", None])
    assert image[0] == plain[0] and image[1] != plain[1] and image[2] != plain[2]
    assert image[1:] != other[1:]
    assert key.block_hashes(tokens, extra_keys=[None, b"image:sha256:aa", None]) == image
    with pytest.raises(ValueError, match="one entry per full block"):
        key.block_hashes(tokens, extra_keys=[None])
    with pytest.raises(TypeError, match=r"extra_keys\[0\]"):
        key.block_hashes(tokens, extra_keys=[3, None, None])


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kw, error, match",
    [
        (dict(block_tokens=0), ValueError, "block_tokens"),
        (dict(block_tokens=-4), ValueError, "block_tokens"),
        (dict(block_tokens=4.0), TypeError, "block_tokens"),
        (dict(block_tokens=True), TypeError, "block_tokens"),
        (dict(tokenizer=""), ValueError, "tokenizer"),
        (dict(tokenizer=3), TypeError, "tokenizer"),
        (dict(weights_id=""), ValueError, "weights_id"),
        (dict(weights_id=None), ValueError, "weights_id.*does not identify its weights"),
        (dict(tp_rank=1), ValueError, "tp_rank"),
        (dict(tp_rank=-1), ValueError, "tp_rank"),
        (dict(scales=1.5), TypeError, "scales"),
        (dict(adapter=""), ValueError, "adapter"),
        (dict(scale_policy=3), TypeError, "scale_policy"),
        (dict(rope_theta=float("nan")), ValueError, "rope_theta"),
        (dict(rope_theta="1e4"), TypeError, "rope_theta"),
        (dict(rope_scaling=[1]), TypeError, "rope_scaling"),
        (dict(rope_scaling={"factor": float("inf")}), ValueError, "rope_scaling"),
        (dict(rope_scaling={1: 2}), TypeError, "rope_scaling"),
    ],
)
def test_bad_fields(kw, error, match):
    with pytest.raises(error, match=match):
        _key(**kw)


def test_bad_models():
    with pytest.raises(TypeError, match="model"):
        _key(object())
    with pytest.raises(ValueError, match="model"):
        _key({})
    with pytest.raises(TypeError, match="model"):
        _key(_with(windows={1, 2}))
    with pytest.raises(ValueError, match="kv_dtype"):
        _key({"name": "m"})


@pytest.mark.parametrize(
    "tokens, error, match",
    [
        ([1, 2.0, 3, 4], TypeError, r"token_ids\[1\]"),
        ([1, True, 3, 4], TypeError, r"token_ids\[1\]"),
        ([1, 2**63], ValueError, r"token_ids\[1\]"),
        ([-(2**63) - 1], ValueError, r"token_ids\[0\]"),
        ([1, 2, np.uint64(2**64 - 1)], ValueError, r"token_ids\[2\]"),
        ([1, "2"], TypeError, r"token_ids\[1\]"),
        (np.array([2**64 - 1], dtype=np.uint64), ValueError, "token_ids"),
        (np.zeros(4, dtype=np.float32), TypeError, "token_ids"),
        (np.zeros((2, 4), dtype=np.int64), ValueError, "token_ids"),
        (torch.zeros(4), TypeError, "token_ids"),
        (torch.zeros(4, dtype=torch.bool), TypeError, "token_ids"),
        ("abcd", TypeError, "token_ids"),
        (5, TypeError, "token_ids"),
    ],
)
def test_bad_token_ids(tokens, error, match):
    with pytest.raises(error, match=match):
        _key().block_hashes(tokens)


def test_bad_parent():
    with pytest.raises(ValueError, match="parent"):
        _key().block_hashes([1, 2, 3, 4], parent="abc")
    with pytest.raises(ValueError, match="parent"):
        _key().block_hashes([1, 2, 3, 4], parent="z" * 64)


# --------------------------------------------------------------------------- BlockIndex


def test_block_index_insert_match_remove():
    key = _key()
    hashes = key.block_hashes(list(range(20)))  # 5 blocks
    index = BlockIndex()
    index.insert(hashes[:3], [7, 3, 9])
    assert len(index) == 3 and hashes[0] in index and hashes[3] not in index
    assert index.match(hashes) == [7, 3, 9]  # longest present prefix
    assert index.match(hashes[:2]) == [7, 3]
    assert index.match([]) == []
    assert index.get(hashes[1]) == 3 and index.hash_of(9) == hashes[2] and index.get(hashes[4]) is None
    assert index.remove([hashes[1], hashes[4]]) == [3]  # absent hashes are skipped
    assert index.match(hashes) == [7]  # stops at the first miss even though hashes[2] is present
    assert index.match(hashes[2:]) == [9]
    index.insert(hashes[1:2], np.array([3]))
    assert index.match(hashes) == [7, 3, 9]
    index.clear()
    assert len(index) == 0 and index.match(hashes) == []


def test_block_index_refuses_remaps_atomically():
    hashes = _key().block_hashes(list(range(12)))
    index = BlockIndex()
    index.insert(hashes[:1], [0])
    index.insert(hashes[:1], [0])  # the same mapping again: a no-op
    with pytest.raises(ValueError, match=r"hashes\[1\]"):
        index.insert([hashes[1], hashes[0]], [1, 5])
    with pytest.raises(ValueError, match=r"host_ids\[1\]"):
        index.insert([hashes[1], hashes[2]], [1, 0])
    with pytest.raises(ValueError, match=r"host_ids\[1\]"):
        index.insert([hashes[1], hashes[2]], [4, 4])
    with pytest.raises(ValueError, match=r"hashes\[1\]"):
        index.insert([hashes[1], hashes[1]], [4, 5])
    assert len(index) == 1 and hashes[1] not in index  # nothing of a refused call was applied
    with pytest.raises(ValueError, match="host_ids"):
        index.insert(hashes[1:3], [1])
    with pytest.raises(ValueError, match="host_ids"):
        index.insert(hashes[1:2], [-1])
    with pytest.raises(TypeError, match="host_ids"):
        index.insert(hashes[1:2], [1.0])
    with pytest.raises(ValueError, match="hashes"):
        index.insert(["not a hash"], [1])
    with pytest.raises(TypeError, match="hashes"):
        index.insert(hashes[1], [1])


def test_one_index_serves_several_keys():
    tokens = list(range(8))
    base, lora = _key(), _key(adapter="lora:a@1")
    index = BlockIndex()
    index.insert(base.block_hashes(tokens), [0, 1])
    index.insert(lora.block_hashes(tokens), [2, 3])
    assert index.match(base.block_hashes(tokens)) == [0, 1]
    assert index.match(lora.block_hashes(tokens)) == [2, 3]
    assert index.match(_key(adapter="lora:a@2").block_hashes(tokens)) == []


# --------------------------------------------------------------------------- properties

tokens_st = st.lists(st.integers(-(2**63), 2**63 - 1), max_size=40)


@settings(max_examples=60, deadline=None)
@given(tokens=tokens_st, block_tokens=st.integers(1, 6), cut=st.integers(0, 40))
def test_chain_property(tokens, block_tokens, cut):
    key = _key(block_tokens=block_tokens)
    hashes = key.block_hashes(tokens)
    assert len(hashes) == len(tokens) // block_tokens
    assert key.block_hashes(tokens[:cut]) == hashes[: min(cut, len(tokens)) // block_tokens]
    assert key.block_hashes(np.array(tokens, dtype=np.int64)) == hashes
    index = BlockIndex()
    index.insert(hashes, list(range(len(hashes))))
    assert index.match(key.block_hashes(tokens[:cut])) == list(range(min(cut, len(tokens)) // block_tokens))


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**20), min_size=1, max_size=40), block_tokens=st.integers(1, 6), data=st.data())
def test_any_token_change_breaks_the_chain_from_its_block(tokens, block_tokens, data):
    key = _key(block_tokens=block_tokens)
    position = data.draw(st.integers(0, len(tokens) - 1))
    changed = list(tokens)
    changed[position] = data.draw(st.integers(0, 2**20).filter(lambda t: t != tokens[position]))
    a, b = key.block_hashes(tokens), key.block_hashes(changed)
    block = position // block_tokens
    assert a[:block] == b[:block]
    assert all(x != y for x, y in zip(a[block:], b[block:], strict=True))
