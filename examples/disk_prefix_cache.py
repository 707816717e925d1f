"""An engine's prefix cache that survives a restart of its process: KV blocks in a kvcopy DiskKVStore.

The engine is a small one written on transformers' model forward. A tiny random-weight Llama (built from a
config and seeded, so every process has the same weights) keeps its KV in a paged cache: one plane per layer
and K/V, of [pages, 16 tokens, KV heads, head dim], the layout engines use. Run it as two processes:

    python examples/disk_prefix_cache.py serve  --store DIR   # prefill a shared prefix, save it, exit
    python examples/disk_prefix_cache.py resume --store DIR   # a new process: match, read, reload, answer

``serve`` prefills a 512-token shared prefix (a system prompt and a document), offloads its full blocks from
the paged cache into a HostKVPool (one TransferEngine submission), and puts them into the store under the
prefix's block hashes. Those hashes come from a kvcopy.CacheKey, which covers the model, its weights, its
rope and its KV dtype. Then the process exits.

``resume`` is a new process, with a question after that prefix. It opens the store. The open is refused,
naming what differs, when the model or its weights are not the ones that wrote it. It then matches the
request's block hashes, and asks the Planner whether reading the matched prefix from disk beats recomputing
it (``decide(..., source="disk")``). Whatever the answer, it takes both paths, one after the other, on a
warm model: it reads the blocks into the host pool, reloads them into pages at random ids, and answers from
there; then it prefills the prefix again into other pages and answers from those. Then it checks itself:
- the reloaded KV must equal, bitwise, a fresh prefill of the same prefix;
- the greedy answer must be the same tokens as an answer from that fresh prefill.
It prints the Planner's prediction for each path next to what the run measured, and exits 1 on any mismatch.

``--profile PATH``: a profile with a disk link (``kvcopy calibrate --disk DIR``). Without one, it
calibrates this machine for this model first: copies, one layer's prefill, and the disk under --store,
about 20 s on a CPU. ``--seed``: the weights' seed (another seed is another model: ``resume`` is refused).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import kvcopy
from kvcopy.calibration.disk import add_disk_fits
from kvcopy.integrations import transformers as kvt
from kvcopy.storage import DiskKVStore

PAGE_TOKENS = 16
PREFIX_TOKENS = 512  # the shared prefix: 32 full pages
QUESTION_TOKENS = 40
ANSWER_TOKENS = 16
PAGES = 128  # the engine's paged cache: room for the prefix, its question and answer, and a fresh copy
STORE_BLOCKS = 256  # the disk store: room for several such prefixes
VOCAB = 512


def build_model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    model = LlamaForCausalLM(config).eval()
    model.set_attn_implementation("sdpa")
    return model


def tokens(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB) for _ in range(count)]


class PagedEngine:
    """The engine's KV: one [pages, PAGE_TOKENS, kv heads, head dim] plane per layer and K/V, as a PagedKV."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        config = model.config
        self.model = model
        self.num_layers = config.num_hidden_layers
        shape = (PAGES, PAGE_TOKENS, config.num_key_value_heads, config.hidden_size // config.num_attention_heads)
        self.planes = [torch.zeros(shape, dtype=model.dtype) for _ in range(2 * self.num_layers)]  # K0, V0, K1...
        self.kv = kvcopy.PagedKV.from_planes(self.planes)

    @torch.inference_mode()
    def prefill(self, token_ids: list[int], pages: list[int]) -> None:
        """Runs the model over ``token_ids`` and writes their KV into ``pages`` (one per PAGE_TOKENS tokens)."""
        cache = DynamicCache()
        self.model(torch.tensor([token_ids]), past_key_values=cache, use_cache=True)
        for layer in range(self.num_layers):
            for plane, full in zip(
                self.planes[2 * layer : 2 * layer + 2],
                (cache.layers[layer].keys, cache.layers[layer].values),
                strict=True,
            ):
                per_token = full[0].transpose(0, 1)  # [tokens, kv heads, head dim]
                plane[pages] = per_token.reshape(len(pages), PAGE_TOKENS, *per_token.shape[1:])

    @torch.inference_mode()
    def answer(self, pages: list[int], question: list[int]) -> tuple[list[int], float]:
        """Greedy tokens after the prefix held in ``pages``, then ``question``; and the seconds from the call to
        the first of them (the question's prefill: what the Planner predicts)."""
        started = time.perf_counter()
        cache = DynamicCache()
        for layer in range(self.num_layers):
            k, v = (
                plane[pages].flatten(0, 1).transpose(0, 1)[None] for plane in self.planes[2 * layer : 2 * layer + 2]
            )
            cache.update(k.clone(), v.clone(), layer)
        out, step = [], torch.tensor([question])
        for _ in range(ANSWER_TOKENS):
            logits = self.model(step, past_key_values=cache, use_cache=True).logits
            out.append(int(logits[0, -1].argmax()))
            if len(out) == 1:
                first = time.perf_counter() - started
            step = torch.tensor([[out[-1]]])
        return out, first


def cache_key(model: LlamaForCausalLM, seed: int) -> kvcopy.CacheKey:
    """What makes a block of this model reusable: its shape, rope and KV dtype, and which weights."""
    return kvcopy.CacheKey(kvt.model_spec(model), weights_id=f"random-init seed {seed}", block_tokens=PAGE_TOKENS)


def serve(args: argparse.Namespace) -> int:
    model = build_model(args.seed)
    engine, prefix = PagedEngine(model), tokens(PREFIX_TOKENS, seed=1)
    pages = random.Random(2).sample(range(PAGES), PREFIX_TOKENS // PAGE_TOKENS)  # where the engine put them
    engine.prefill(prefix, pages)
    pool = kvcopy.HostKVPool(engine.kv, len(pages), pin_memory=False)
    host_ids = pool.allocate(len(pages)).tolist()
    with kvcopy.TransferEngine(engine.kv, pool) as copies:
        copies.offload(pages, host_ids).wait()
    key = cache_key(model, args.seed)
    path = os.path.join(args.store, "prefixes")
    if os.path.exists(path):
        store = DiskKVStore.open(path, pool, cache_key=key)
    else:
        store = DiskKVStore.create(path, pool, STORE_BLOCKS, cache_key=key)
    with store:
        put = store.put(key.block_hashes(prefix), pool, host_ids)
        put.wait()  # committed: from here on the blocks survive this process
    saved = "already held" if put.num_descriptors == 0 else f"saved in {put.num_descriptors} NIXL descriptor(s)"
    print(f"serve: {len(pages)} blocks ({PREFIX_TOKENS} tokens) of the shared prefix in {path}, {saved}")
    return 0


def _profile(args: argparse.Namespace, spec: kvcopy.ModelSpec) -> kvcopy.Profile:
    if args.profile:
        return kvcopy.Profile.load(args.profile)
    print("calibrating this machine for this model (copies, one layer's prefill, the disk)...")
    profile = kvcopy.calibrate("cpu", quick=True, progress=False, model=spec)
    return add_disk_fits(profile, args.store, progress=False)


def resume(args: argparse.Namespace) -> int:
    model = build_model(args.seed)
    engine, spec = PagedEngine(model), kvt.model_spec(model)
    request = tokens(PREFIX_TOKENS, seed=1) + tokens(QUESTION_TOKENS, seed=3)
    key = cache_key(model, args.seed)
    pool = kvcopy.HostKVPool(engine.kv, STORE_BLOCKS // 4, pin_memory=False)
    planner = kvcopy.Planner.from_profile(_profile(args, spec), spec, block_tokens=PAGE_TOKENS)
    try:
        store = DiskKVStore.open(os.path.join(args.store, "prefixes"), pool, cache_key=key)
    except ValueError as err:  # another model or other weights: never read as this one's
        print(f"resume: the store is not this model's: {err}")
        return 2
    with store, kvcopy.TransferEngine(engine.kv, pool) as copies:
        with torch.inference_mode():  # a warm engine: its first forward's one-time costs are not either path's
            model(torch.tensor([request[:PAGE_TOKENS]]))
        started = time.perf_counter()
        slots = store.match(key.block_hashes(request))
        cached = len(slots) * PAGE_TOKENS
        if not slots:
            print("resume: no stored prefix matches this request")
            return 2
        decision = planner.decide(cached, len(request) - cached, source="disk")
        pages = random.Random(4).sample(range(PAGES // 2), len(slots))  # this process's pages for it
        host_ids = pool.allocate(len(slots)).tolist()
        store.get(slots, pool, host_ids).wait()  # each block's checksum checked against its commit
        copies.reload(host_ids, pages).wait()
        loaded = time.perf_counter() - started
        answer, first = engine.answer(pages, request[cached:])
        measured_disk = loaded + first

        started = time.perf_counter()  # the other path: prefill the whole prefix again, in other pages
        fresh = random.Random(5).sample(range(PAGES // 2, PAGES), len(slots))
        engine.prefill(request[:cached], fresh)
        prefilled = time.perf_counter() - started
        again, first = engine.answer(fresh, request[cached:])
        measured_recompute = prefilled + first
    same_kv = all(torch.equal(plane[pages], plane[fresh]) for plane in engine.planes)
    print(
        f"resume: matched {len(slots)} blocks ({cached} of {len(request)} tokens) in the store, "
        f"read and reloaded into pages {pages[:4]}..."
    )
    print(f"resume: planner says {decision.action}: {decision.explanation}")
    new = len(request) - cached
    print(f"resume: to the first token of the answer ({cached} cached + {new} new tokens), predicted / measured:")
    print(f"  read from disk, reload, prefill the rest: {decision.t_fetch * 1e3:8.1f} / {measured_disk * 1e3:8.1f} ms")
    print(
        f"  recompute the prefix and the rest:        {decision.t_recompute * 1e3:8.1f} / "
        f"{measured_recompute * 1e3:8.1f} ms"
    )
    print(f"resume: KV read back equals a fresh prefill bitwise: {same_kv}; same answer: {answer == again} {answer}")
    return 0 if same_kv and answer == again else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("serve", "resume"))
    parser.add_argument("--store", required=True, help="a directory on the disk that keeps the prefix cache")
    parser.add_argument("--profile", help="a profile with a disk link (default: calibrate now)")
    parser.add_argument("--seed", type=int, default=0, help="the weights' seed (default 0)")
    args = parser.parse_args()
    os.makedirs(args.store, exist_ok=True)
    return serve(args) if args.command == "serve" else resume(args)


if __name__ == "__main__":
    sys.exit(main())
