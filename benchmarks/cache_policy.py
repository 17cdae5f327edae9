"""Eviction policies of the offloaded-expert cache, replayed over recorded routing traces (CPU only).

1. Record. The real verifier core (verifier_svc.engine.VerifierCore, offloaded MXFP4 experts, the real
   verifier_svc.expert_cache.ExpertCache) decodes while a recording subclass of the cache logs every call the
   forwards make: `begin(projection)` (a verify arrives with its projected union = the previous verify's routed
   union, as the drafter sends it), per MoE layer `lookup(layer, routed experts)` / `release()` / `prefetch({l+1:
   the next layer's router's guess})` / `advance(layer)`, and the forward boundaries (prefill or verify, tokens
   emitted). Routing does not depend on the cache, so one trace serves every cache size and policy.
   Recording takes ~7 min on 2 cores (the demo's 3 x 1024 tokens ~5 min; the real-shape model's MXFP4 quantization
   ~2.5 min at load); `--save-traces FILE` keeps the traces and `--traces FILE` replays them again in seconds.
   Workloads: (a) the embedded trained demo target (pdflash/assets/demo: 6 layers x 8 experts, top-2) on the
   held-out stdlib prompts (benchmarks/prompts_heldout.json), block 1 (no drafts) and the n-gram drafter at block
   8 and 16 (adaptive width, as benchmarks/inprocess.py drives it); (b) a random-weight model with Qwen3-30B-A3B
   layer shapes (pdflash.tiny.make_real_shape_checkpoint, --real-layers layers x 128 experts, top-8), prompts
   = the same held-out text re-tokenized with its tokenizer, block 1 and n-gram at block 16.
2. Replay. A model of the cache with the same rules (pins until release, a prefetch takes only free slots and
   slots that are neither pinned nor prefetched-unused, the union window of begin/advance) replays each trace at
   10%, 25% and 50% of the expert slots under each victim policy:
     lru          the least recently used slot (today's ExpertCache)
     lfu          routing frequency with exponential decay (half-life --lfu-half-life forwards; counts kept for
                  every expert, resident or not), least frequent evicted, ties LRU
     protect      LRU among slots outside the projected union of the verify in flight, LRU if none
     proj-next    outside the projection: LRU first; inside it: the slot whose layer comes back last in the
                  forward's layer order (the layer just run is needed again only in the next forward)
     live-next    proj-next with the projection learned by the cache itself: a slot is "live" while its expert
                  was routed at its layer's latest lookup (no drafter needed, also through prefill)
     cyclic       ExpertCache(eviction="cyclic") (verifier_svc/expert_cache.py): live-next made cheap: cold slots
                  (turned cold by their layer's lookup) in the order they turned cold, then expected slots (routed
                  at the latest lookup or prefetched since) by layer, furthest in the cycle first
     belady       offline optimum: the slot whose next demand lookup is furthest away (a prefetch of an expert
                  needed later than that is skipped): an upper bound, not a policy
   in two modes: demand (prefetch none: lookups only, where belady is the true optimum) and prefetch (the
   recorded union window + next-layer guesses, the server's default `union,layer`). A lookup that finds every
   slot pinned (a cache below one layer's routed experts, which the real cache refuses at load) streams the
   expert without keeping it: counted as a miss and bytes.
   Checks: the replay of lru in the recorded mode at the recorded cache size equals the real cache's counters
   of the recorded run; the replays of lru and cyclic equal the same trace replayed through the real ExpertCache
   (over a byte-free store) at every size it accepts (at least the widest lookup of the trace).

Columns: hit rate of the verify forwards' lookups (a prefetched expert found resident counts as a hit, as in
ExpertCache); expert bytes moved host->device (demand + prefetch) per output token of the verify forwards.
Prefill is replayed (it fills the cache) but not counted in those columns (the JSON has it).

    python benchmarks/cache_policy.py [--out benchmarks/results] [--prompts 8] [--new-tokens 128]
                                      [--real-layers 4] [--real-prompts 2] [--real-new-tokens 32] [--skip-real]
"""

from __future__ import annotations

import argparse
import bisect
import collections
import dataclasses
import json
import math
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.inprocess import core_run, ngram_propose  # noqa: E402
from verifier_svc.expert_cache import ExpertCache  # noqa: E402

SIZES = (0.10, 0.25, 0.50)
POLICIES = ("lru", "lfu", "protect", "proj-next", "live-next", "cyclic", "belady")


# ---- recording ------------------------------------------------------------------------------------------
class RecordingCache(ExpertCache):
    """ExpertCache that logs the calls a forward makes (set as the live cache's class after load)."""

    trace: list

    def lookup(self, layer, experts):
        self.trace.append(("L", int(layer), sorted({int(e) for e in experts})))
        return super().lookup(layer, experts)

    def release(self):
        self.trace.append(("R",))
        return super().release()

    def prefetch(self, union):
        self.trace.append(("P", {int(l): sorted(int(e) for e in es) for l, es in union.items()}))
        return super().prefetch(union)

    def begin(self, projection):
        self.trace.append(("B", {int(l): sorted(int(e) for e in es) for l, es in projection.items()}))
        return super().begin(projection)

    def advance(self, layer):
        self.trace.append(("A", int(layer)))
        return super().advance(layer)


def record(core, prompts, new_tokens: int, block: int, propose) -> dict:
    """Decode `prompts` through `core` with its cache recording; returns the trace and the real cache's counters."""
    cache = core.target.expert_cache
    cache.__class__ = RecordingCache
    cache.trace = trace = []
    before = dataclasses.replace(cache.stats)
    prefill, verify = core.prefill, core.verify

    def wrap(kind, fn):
        def call(*a, **k):
            trace.append(("S", kind))
            res = fn(*a, **k)
            trace.append(("E", kind, len(res.tokens)))
            return res
        return call

    core.prefill, core.verify = wrap("prefill", prefill), wrap("verify", verify)
    try:
        r = core_run(core, prompts, new_tokens, block, propose)
    finally:
        core.prefill, core.verify = prefill, verify
        cache.__class__ = ExpertCache
        del cache.trace
    return {"trace": trace, "real": cache.stats.minus(before).as_dict(), "real_slots": cache.num_slots,
            "prefetch": sorted(k for k, on in (("union", cache.prefetch_union), ("layer", cache.layer_ahead)) if on),
            "tokens": r["tokens"], "rounds": r["rounds"], "outputs": r["outputs"]}


def none_propose(i, prompt, out, k, state):
    return []


# ---- replay ---------------------------------------------------------------------------------------------
class Policy:
    """Victim choice of the simulated cache. `eligible(key)`: not pinned (and for a prefetch, not prefetched-unused)."""

    def __init__(self, sim):
        self.sim = sim
        self.order: collections.OrderedDict = collections.OrderedDict()  # LRU order, least recent first

    def touch(self, key):
        self.order.move_to_end(key)

    def insert(self, key):
        self.order[key] = None

    def evict(self, key):
        del self.order[key]

    def victim(self, eligible, incoming=None):
        for k in self.order:
            if eligible(k):
                return k
        return None


class LRU(Policy):
    pass


class LFU(Policy):
    """Exponentially decayed routing counts (per forward), kept for every expert; least frequent evicted."""

    def __init__(self, sim, half_life: float):
        super().__init__(sim)
        self.growth = 2 ** (1 / half_life)  # scores in units that grow per forward instead of decaying all counts
        self.score: dict = collections.defaultdict(float)

    def count(self, key):
        self.score[key] += self.growth ** self.sim.forwards

    def victim(self, eligible, incoming=None):
        best = None
        for k in self.order:  # ties: least recent first
            if eligible(k) and (best is None or self.score[k] < self.score[best]):
                best = k
        return best


class Protect(Policy):
    """LRU among slots outside the projected union of the verify in flight."""

    def victim(self, eligible, incoming=None):
        proj = self.sim.projection
        fallback = None
        for k in self.order:
            if eligible(k):
                if k[1] not in proj.get(k[0], ()):
                    return k
                if fallback is None:
                    fallback = k
        return fallback


class ProjNext(Policy):
    """Outside the projection (or not live, for `cyclic`): LRU first. Inside: the slot whose layer the forward
    reaches last from the layer now running (cyclic in the layer order)."""

    def __init__(self, sim, learned: bool):
        super().__init__(sim)
        self.learned = learned
        self.last_routed: dict[int, frozenset] = {}

    def routed(self, layer, experts):
        self.last_routed[layer] = frozenset(experts)

    def hot(self, key) -> bool:
        if self.learned:
            return key[1] in self.last_routed.get(key[0], ())
        return key[1] in self.sim.projection.get(key[0], ())

    def victim(self, eligible, incoming=None):
        cur, pos = self.sim.current_layer, self.sim.layer_pos
        n = len(pos)
        best, best_d = None, -1
        for k in self.order:
            if not eligible(k):
                continue
            if not self.hot(k):
                return k
            d = (pos[k[0]] - pos.get(cur, -1) - 1) % n  # layers run before this key's layer comes back
            if d > best_d:
                best, best_d = k, d
        return best


class Cyclic(Policy):
    """ExpertCache(eviction="cyclic") over keys: cold keys first (the earliest turned cold), else an expected key of
    the layer whose next lookup is furthest in the layer cycle."""

    def __init__(self, sim):
        super().__init__(sim)
        self.cold: collections.OrderedDict = collections.OrderedDict()
        self.expected: dict[int, dict] = {l: {} for l in sim.layer_pos}
        self.layers = sorted(sim.layer_pos)
        self.cursor = 0

    def touch(self, key):
        pass

    def insert(self, key):
        self.expected[key[0]][key] = None

    def evict(self, key):
        if key in self.cold:
            del self.cold[key]
        else:
            del self.expected[key[0]][key]

    def routed(self, layer, experts):
        exp = self.expected[layer]
        routed = set(experts)
        for k in [k for k in exp if k[1] not in routed]:
            del exp[k]
            self.cold[k] = None
        for e in experts:
            k = (layer, e)
            if k in self.sim.resident and k not in exp:
                self.cold.pop(k, None)
                exp[k] = None
        self.cursor = self.sim.layer_pos[layer]

    def victim(self, eligible, incoming=None):
        for k in self.cold:
            if eligible(k):
                return k
        n = len(self.layers)
        for i in range(n):
            for k in self.expected[self.layers[(self.cursor - i) % n]]:
                if eligible(k):
                    return k
        return None


class Belady(Policy):
    def __init__(self, sim, uses: dict):
        super().__init__(sim)
        self.uses = uses  # key -> sorted event positions of its lookups

    def next_use(self, key) -> float:
        u = self.uses.get(key)
        if not u:
            return math.inf
        i = bisect.bisect_right(u, self.sim.pos)
        return u[i] if i < len(u) else math.inf

    def victim(self, eligible, incoming=None):
        best, best_t = None, -1.0
        for k in self.order:
            if eligible(k):
                t = self.next_use(k)
                if t > best_t:
                    best, best_t = k, t
                    if t == math.inf:
                        break
        if incoming is not None and best is not None and self.next_use(incoming) >= best_t:
            return "skip"  # a prefetch the optimum would not make
        return best


@dataclasses.dataclass
class Counts:
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    prefetched: int = 0
    prefetch_used: int = 0
    wasted: int = 0
    bypassed: int = 0  # demand misses with every slot pinned (streamed, not kept)

    @property
    def moved(self) -> int:  # slices host -> device
        return self.misses + self.prefetched


class SimCache:
    """ExpertCache's rules over keys only, the victim from a Policy."""

    def __init__(self, slots: int, num_experts: dict[int, int], policy: str, prefetch: bool, uses: dict, half_life: float):
        self.slots, self.prefetch_on = slots, prefetch
        self.layer_pos = {l: i for i, l in enumerate(sorted(num_experts))}
        self.resident: set = set()
        self.pinned: set = set()
        self.unused: set = set()
        self.projection: dict[int, frozenset] = {}
        self.window = 0
        self.current_layer = None
        self.forwards = 0
        self.pos = 0
        self.phase = "prefill"
        self.counts = {"prefill": Counts(), "verify": Counts()}
        self.policy = {"lru": lambda: LRU(self), "lfu": lambda: LFU(self, half_life), "protect": lambda: Protect(self),
                       "proj-next": lambda: ProjNext(self, False), "live-next": lambda: ProjNext(self, True),
                       "cyclic": lambda: Cyclic(self),
                       "belady": lambda: Belady(self, uses)}[policy]()

    @property
    def c(self) -> Counts:
        return self.counts[self.phase]

    def _take(self, prefetch: bool, key):
        if len(self.resident) < self.slots:
            return True
        ok = (lambda k: k not in self.pinned and k not in self.unused) if prefetch else (lambda k: k not in self.pinned)
        v = self.policy.victim(ok, key if prefetch else None)
        if v is None or v == "skip":
            return v
        self.resident.discard(v)
        self.policy.evict(v)
        self.c.evictions += 1
        if v in self.unused:
            self.unused.discard(v)
            self.c.wasted += 1
        return True

    def lookup(self, layer, experts):
        self.current_layer = layer
        keys = [(layer, e) for e in experts]
        lfu = isinstance(self.policy, LFU)
        if isinstance(self.policy, Cyclic):
            self.policy.routed(layer, experts)
        for k in keys:
            if k in self.resident:
                self.pinned.add(k)
        for k in keys:
            self.c.lookups += 1
            if lfu:
                self.policy.count(k)
            if k in self.resident:
                self.c.hits += 1
                self.policy.touch(k)
                if k in self.unused:
                    self.unused.discard(k)
                    self.c.prefetch_used += 1
            else:
                self.c.misses += 1
                if self._take(False, k) is True:
                    self.resident.add(k)
                    self.policy.insert(k)
                else:
                    self.c.bypassed += 1
                    continue
            self.pinned.add(k)
        if isinstance(self.policy, ProjNext):
            self.policy.routed(layer, experts)

    def release(self):
        self.pinned.clear()

    def prefetch(self, union) -> None:
        for layer in sorted(union):
            if layer not in self.layer_pos:
                continue
            for e in sorted(union[layer]):
                k = (layer, e)
                if k in self.resident:
                    continue
                got = self._take(True, k)
                if got is None:
                    return
                if got == "skip":
                    continue
                self.resident.add(k)
                self.policy.insert(k)
                self.unused.add(k)
                self.c.prefetched += 1

    def _window_of(self, projection) -> int:
        per_layer = max(1.0, sum(len(e) for e in projection.values()) / max(1, len(projection)))
        return max(1, int(self.slots / 2 / per_layer))

    def begin(self, projection):
        self.projection = {l: frozenset(e) for l, e in projection.items() if l in self.layer_pos and e}
        if not self.projection:
            self.window = 0
            return
        self.window = self._window_of(self.projection)
        layers = sorted(self.projection)
        if self.prefetch_on:
            self.prefetch({l: self.projection[l] for l in layers[: self.window]})

    def advance(self, layer):
        if self.prefetch_on and self.projection and layer + self.window in self.projection:
            self.prefetch({layer + self.window: self.projection[layer + self.window]})

    def run(self, trace) -> dict:
        tokens = {"prefill": 0, "verify": 0}
        for self.pos, ev in enumerate(trace):
            op = ev[0]
            if op == "L":
                self.lookup(ev[1], ev[2])
            elif op == "R":
                self.release()
            elif op == "P":
                if self.prefetch_on:
                    self.prefetch(ev[1])
            elif op == "A":
                self.advance(ev[1])
            elif op == "B":
                self.begin(ev[1])
            elif op == "S":
                self.phase = ev[1]
                self.forwards += 1
                if ev[1] == "prefill":
                    self.projection = {}
            elif op == "E":
                tokens[ev[1]] += ev[2]
        return {"counts": {p: dataclasses.asdict(c) for p, c in self.counts.items()}, "tokens": tokens}


class _NullStore:
    """What ExpertCache reads of a store, one byte per slice (replays count slices, not bytes)."""

    def __init__(self, num_experts: dict[int, int]):
        self.num_experts = dict(sorted(num_experts.items()))
        self.slice_bytes, self.big_scales = 1, False
        self._byte = torch.zeros(1, dtype=torch.uint8)

    def slice(self, layer, expert):
        return self._byte

    def weights(self, pool):
        return dataclasses.make_dataclass("W", ["big_scales"])(False)

    def refresh(self, w, pool):
        return w


def replay_real(trace, num_experts: dict[int, int], slots: int, eviction: str, prefetch: bool) -> dict | None:
    """The trace through a real ExpertCache (None: the cache is smaller than the trace's widest lookup)."""
    if slots < max((len(ev[2]) for ev in trace if ev[0] == "L"), default=0):
        return None
    cache = ExpertCache(_NullStore(num_experts), slots, torch.device("cpu"), need=1,
                        prefetch="union,layer" if prefetch else "none", eviction=eviction)
    for ev in trace:
        op = ev[0]
        if op == "L":
            cache.lookup(ev[1], ev[2])
        elif op == "R":
            cache.release()
        elif op == "P" and prefetch:
            cache.prefetch(ev[1])
        elif op == "A":
            cache.advance(ev[1])
        elif op == "B":
            cache.begin(ev[1] if prefetch else {})
    return cache.stats.as_dict()


def load_trace(t: dict) -> dict:
    """A trace read back from JSON: layer keys are ints again."""
    t["num_experts"] = {int(k): v for k, v in t["num_experts"].items()}
    t["trace"] = [(ev[0], {int(k): v for k, v in ev[1].items()}) if ev[0] in ("P", "B") else tuple(ev) for ev in t["trace"]]
    return t


def lookup_uses(trace) -> dict:
    uses: dict = collections.defaultdict(list)
    for i, ev in enumerate(trace):
        if ev[0] == "L":
            for e in ev[2]:
                uses[(ev[1], e)].append(i)
    return uses


def replay(trace, num_experts: dict[int, int], slots: int, policy: str, prefetch: bool, half_life: float, uses=None) -> dict:
    sim = SimCache(slots, num_experts, policy, prefetch, uses if uses is not None else lookup_uses(trace), half_life)
    return sim.run(trace)


# ---- workloads ------------------------------------------------------------------------------------------
def offloaded_core(model_dir, max_block: int):
    """The verifier core over `model_dir` with offloaded MXFP4 experts (the cache is replaced by `fresh_cache`)."""
    from verifier_svc.engine import VerifierCore
    from verifier_svc.model import load_target

    target = load_target(model_dir, "cpu", "auto", experts="mxfp4", expert_cache_gb=1e9)
    return VerifierCore(target, max_block_size=max_block, max_tokens_limit=4096)


def fresh_cache(core, fraction: float) -> ExpertCache:
    """An empty cache of `fraction` of the experts (at least one layer's), the experts modules bound to it (a rebind
    only: serving the model anew would reset the experts implementation and drop the route capture)."""
    from pdflash_kernels.installer import experts_modules
    from verifier_svc.expert_cache import min_slots

    store = core.target.expert_cache.store
    slots = max(min_slots(store), round(fraction * sum(store.num_experts.values())))
    cache = ExpertCache(store, slots, torch.device("cpu"), need=min_slots(store))
    for layer, module in experts_modules(core.target.model).items():
        module._pdflash_offload = (cache, layer)
    core.target.expert_cache = memoize_dequant.cache = cache
    return cache


def memoize_dequant() -> None:
    """The CPU reference kernel dequantizes a slot's MXFP4 bytes on every call (most of a real-shape forward's time
    on 2 cores). Memoize by the slot's bytes' identity (its owner in the live cache): the same function, the same
    values, computed once per expert."""
    import pdflash_kernels.reference as ref

    orig = ref.expert_matrices

    def expert_matrices(w, slot):
        memo = memoize_dequant.memo
        cache = memoize_dequant.cache
        key = cache._owner[slot] if cache is not None and w.w1.data_ptr() == cache.weights.w1.data_ptr() else None
        if key is None:
            return orig(w, slot)
        if key not in memo:
            memo[key] = tuple(m.to(torch.bfloat16) for m in orig(w, slot))  # MXFP4 values are exact in bf16
        return tuple(m.float() for m in memo[key])

    ref.expert_matrices = expert_matrices


memoize_dequant.cache = None
memoize_dequant.memo = {}  # (layer, expert) -> its matrices; emptied per model


def demo_prompts(n: int, tokens: int) -> list[list[int]]:
    prompts = json.loads((ROOT / "benchmarks" / "prompts_heldout.json").read_text())
    return [p[:tokens] for p in prompts[:n]]


def retokenized(prompts, target_dir, tokens: int) -> list[list[int]]:
    """The demo's held-out prompts as text, tokenized with another model's tokenizer."""
    from transformers import AutoTokenizer

    from pdflash.defaults import default_target_dir

    src = AutoTokenizer.from_pretrained(str(default_target_dir()))
    dst = AutoTokenizer.from_pretrained(str(target_dir))
    return [dst.encode(src.decode(p))[:tokens] for p in prompts]


def record_workloads(args) -> list[dict]:
    from pdflash.defaults import default_target_dir

    out = []
    runs = [("demo", str(default_target_dir()), demo_prompts(args.prompts, args.prompt_tokens), args.new_tokens,
             [("block 1", 1, none_propose), ("ngram@8", 8, ngram_propose), ("ngram@16", 16, ngram_propose)])]
    if not args.skip_real:
        from pdflash.tiny import make_real_shape_checkpoint

        d = pathlib.Path(args.real_dir) / f"qwen3_moe_{args.real_layers}l"
        if not (d / "config.json").exists():
            t0 = time.perf_counter()
            make_real_shape_checkpoint(d, "qwen3_moe", num_layers=args.real_layers, device="cpu")
            print(f"made {d} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        prompts = retokenized(demo_prompts(args.real_prompts, 128), d, args.real_prompt_tokens)
        runs.append((f"qwen3-shape-{args.real_layers}l (random)", str(d), prompts, args.real_new_tokens,
                     [("block 1", 1, none_propose), ("ngram@16", 16, ngram_propose)]))
    memoize_dequant()
    for name, model_dir, prompts, new, modes in runs:
        t0 = time.perf_counter()
        memoize_dequant.memo = {}
        core = offloaded_core(model_dir, max(b for _, b, _ in modes))
        print(f"{name}: loaded in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        reference = None
        for mode, block, propose in modes:
            t0 = time.perf_counter()
            fresh_cache(core, args.record_fraction)  # every trace starts from an empty cache, as its replays do
            r = record(core, prompts, new, block, propose)
            if reference is None:
                reference = r["outputs"]
            store = core.target.expert_cache.store
            out.append({"model": name, "mode": mode, "block": block, "num_experts": store.num_experts,
                        "slice_bytes": store.slice_bytes, "prompts": len(prompts), "new_tokens": new,
                        "identical_to_block1": r["outputs"] == reference, **{k: v for k, v in r.items() if k != "outputs"}})
            print(f"  {mode}: {r['tokens']} tokens, {r['rounds']} rounds, {len(r['trace'])} events in "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        memoize_dequant.cache = None
        del core
    return out


# ---- main -----------------------------------------------------------------------------------------------
def evaluate(traces, half_life: float) -> list[dict]:
    rows = []
    for t in traces:
        num_experts = {int(k): v for k, v in t["num_experts"].items()}
        total = sum(num_experts.values())
        uses = lookup_uses(t["trace"])
        for mode in ("demand", "prefetch"):
            for frac in SIZES:
                slots = max(1, round(frac * total))
                for pol in POLICIES:
                    r = replay(t["trace"], num_experts, slots, pol, mode == "prefetch", half_life, uses)
                    v = r["counts"]["verify"]
                    toks = r["tokens"]["verify"]
                    rows.append({"model": t["model"], "mode": t["mode"], "prefetch": mode, "fraction": frac, "slots": slots,
                                 "policy": pol, "hit_rate": v["hits"] / v["lookups"] if v["lookups"] else None,
                                 "bytes_per_token": v["misses"] * t["slice_bytes"] / toks + v["prefetched"] * t["slice_bytes"] / toks,
                                 "verify": v, "prefill": r["counts"]["prefill"], "tokens": r["tokens"]})
    return rows


def check_replay(t, half_life: float) -> bool:
    """The replay's lru at the recorded size and mode reproduces the real cache's counters."""
    num_experts = {int(k): v for k, v in t["num_experts"].items()}
    r = replay(t["trace"], num_experts, t["real_slots"], "lru", bool(t["prefetch"]), half_life)
    c = [r["counts"]["prefill"][k] + r["counts"]["verify"][k] for k in ("lookups", "hits", "misses", "evictions", "prefetched", "prefetch_used")]
    real = t["real"]
    return c == [real[k] for k in ("lookups", "hits", "misses", "evictions", "prefetched", "prefetch_used")] and \
        r["counts"]["prefill"]["wasted"] + r["counts"]["verify"]["wasted"] == real["wasted_bytes"] // t["slice_bytes"]


def check_impl(t, rows) -> list[str]:
    """The replays of lru and cyclic against the real ExpertCache on the same trace; returns the mismatches."""
    bad = []
    names = ("lookups", "hits", "misses", "evictions", "prefetched", "prefetch_used")
    for r in rows:
        if (r["model"], r["mode"]) != (t["model"], t["mode"]) or r["policy"] not in ("lru", "cyclic"):
            continue
        real = replay_real(t["trace"], t["num_experts"], r["slots"], r["policy"], r["prefetch"] == "prefetch")
        if real is None:
            continue
        sim = [r["prefill"][k] + r["verify"][k] for k in names] + [r["prefill"]["wasted"] + r["verify"]["wasted"]]
        if sim != [real[k] for k in names] + [real["wasted_bytes"]]:
            bad.append(f"{r['policy']} {r['prefetch']} {r['slots']} slots")
        r["checked_against_expert_cache"] = True
    return bad


def markdown(rows, traces, meta) -> str:
    md = [f"# Expert-cache eviction policies, trace replay (`{meta['command']}`)", "",
          f"{meta['machine']}. Traces recorded through the real ExpertCache while VerifierCore decoded (greedy, in process); "
          "replayed per policy at 10/25/50% of the expert slots. Hit rate: the verify forwards' lookups; MB/token: expert "
          "bytes moved (demand + prefetch) in the verify forwards per output token. Bold: the fewest bytes per token of the non-oracle policies in the row (with prefetch on, a prefetched expert counts as a hit but its bytes still move: bytes are the cost).", "",
          "| trace | forwards | replay checks |", "|---|---|---|"]
    for t in traces:
        md.append(f"| {t['model']} {t['mode']} | {t['rounds']} verifies, {t['tokens']} tokens, {t['prompts']} prompts | "
                  f"{'lru replay = the recorded cache counters' if t['replay_ok'] else 'MISMATCH with the recorded counters'}; "
                  f"{'lru, cyclic replays = ExpertCache replays' if not t['impl_mismatches'] else 'MISMATCH with ExpertCache: ' + ', '.join(t['impl_mismatches'])}"
                  f"{'' if t['identical_to_block1'] else '; tokens differ from block 1 (CPU forwards are not batch-invariant)'} |")
    for mode in ("demand", "prefetch"):
        md += ["", f"## {mode} ({'lookups only' if mode == 'demand' else 'union window + next-layer guesses, the default union,layer'})", "",
               "| trace | cache | " + " | ".join(POLICIES) + " |", "|---|---|" + "---|" * len(POLICIES)]
        keys = sorted({(r["model"], r["mode"], r["fraction"], r["slots"]) for r in rows if r["prefetch"] == mode},
                      key=lambda k: ([t["model"] for t in traces].index(k[0]), [t["mode"] for t in traces if t["model"] == k[0]].index(k[1]), k[2]))
        for model, m, frac, slots in keys:
            cell = {r["policy"]: r for r in rows if (r["prefetch"], r["model"], r["mode"], r["fraction"]) == (mode, model, m, frac)}
            best = min((p for p in POLICIES if p != "belady"), key=lambda p: (cell[p]["bytes_per_token"], -cell[p]["hit_rate"]))
            cells = []
            for p in POLICIES:
                s = f"{cell[p]['hit_rate']:.3f} / {cell[p]['bytes_per_token'] / 1e6:.2f}"
                cells.append(f"**{s}**" if p == best else s)
            md.append(f"| {model} {m} | {int(frac * 100)}% ({slots}) | " + " | ".join(cells) + " |")
    mins = {t["model"]: max(t["num_experts"].values()) for t in traces}
    md += ["", "Cells: hit rate / MB moved per output token. The real cache refuses fewer slots than one layer's experts ("
           + ", ".join(f"{m}: {n}" for m, n in mins.items()) + "): smaller rows are what-ifs in which a lookup that finds every "
           "slot pinned streams the expert without keeping it."]
    return "\n".join(md) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--real-layers", type=int, default=4)
    ap.add_argument("--real-prompts", type=int, default=2)
    ap.add_argument("--real-prompt-tokens", type=int, default=64)
    ap.add_argument("--real-new-tokens", type=int, default=32)
    ap.add_argument("--real-dir", default="/tmp/pdflash_cache_policy", help="where the random real-shape checkpoint is written (once)")
    ap.add_argument("--skip-real", action="store_true")
    ap.add_argument("--record-fraction", type=float, default=0.25, help="cache size the traces are recorded at (clamped to one layer)")
    ap.add_argument("--lfu-half-life", type=float, default=8.0, help="lfu: forwards after which a routing count weighs half")
    ap.add_argument("--traces", default="", help="read traces from this JSON instead of recording (written by --save-traces)")
    ap.add_argument("--save-traces", default="", help="write the recorded traces here (large; not under results/)")
    args = ap.parse_args(argv)
    import platform

    torch.manual_seed(0)
    if args.traces:
        traces = [load_trace(t) for t in json.loads(pathlib.Path(args.traces).read_text())]
    else:
        traces = record_workloads(args)
        if args.save_traces:
            pathlib.Path(args.save_traces).write_text(json.dumps(traces))
    for t in traces:
        t["replay_ok"] = check_replay(t, args.lfu_half_life)
    t0 = time.perf_counter()
    rows = evaluate(traces, args.lfu_half_life)
    for t in traces:
        t["impl_mismatches"] = check_impl(t, rows)
    print(f"replayed in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    meta = {"command": "python benchmarks/cache_policy.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}",
            "lfu_half_life": args.lfu_half_life, "sizes": SIZES, "policies": POLICIES}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = [{k: v for k, v in t.items() if k != "trace"} for t in traces]
    (out / "cache_policy_cpu.json").write_text(json.dumps({"meta": meta, "traces": summary, "rows": rows}, indent=1))
    md = markdown(rows, traces, meta)
    (out / "cache_policy_cpu.md").write_text(md)
    print(md)
    return 0 if all(t["replay_ok"] and not t["impl_mismatches"] for t in traces) else 1


if __name__ == "__main__":
    sys.exit(main())
